"""Every entry point's bad flag is one line naming it: no usage block, exit code 2."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from peft_pretraining.cli import OneLineErrorParser

REPO = Path(__file__).resolve().parent.parent
# utils/'s scripts: its top level and the rooms of scripts (the library rooms, instruments/ and study/, hold modules)
SCRIPT_FILES = [path for folder in ("", "bench", "gpu") for path in (REPO / "utils" / folder).glob("*.py")
                if path.name != "__init__.py"]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


ENTRY_POINTS = sorted(["peft_pretraining.training.args_utils", "layer_remove",
                       *(module_name(path) for path in SCRIPT_FILES if "def build_parser" in path.read_text())])


def test_the_entry_points_are_found():
    assert {"utils.angular_analysis", "utils.compare_norms", "utils.depth_sweep", "layer_remove"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("module_name", ENTRY_POINTS)
def test_every_entry_point_parses_with_one_line_errors(module_name, capsys):
    parser = importlib.import_module(module_name).build_parser()
    assert isinstance(parser, OneLineErrorParser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--no_such_flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # one line, naming a flag: the unknown one, or a required one that comes first
    assert err.count("\n") == 1 and "error: " in err and " --" in err and "usage:" not in err, err


@pytest.mark.e2e
def test_a_script_run_from_the_shell_prints_one_line():
    result = subprocess.run([sys.executable, "utils/jacobian_analysis.py", "--probes", "many"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--probes" in result.stderr, result.stderr


def tools() -> set[str]:
    """The command-line scripts: torchrun_main.py, layer_remove.py and utils/'s scripts that run as __main__."""
    return {"torchrun_main", "layer_remove",
            *(module_name(path) for path in SCRIPT_FILES if "__main__" in path.read_text())}


def imported_tools(source: str, tool_names: set[str]) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found & tool_names


def test_no_module_imports_a_tool():
    """Scripts import library code (utils/instruments, utils/study, peft_pretraining), never each other."""
    names = tools()
    assert {"utils.angular_analysis", "utils.width_sweep", "utils.gpu.gpu_check"} <= names
    offenders = {}
    for path in [REPO / "torchrun_main.py", REPO / "layer_remove.py", *(REPO / "utils").rglob("*.py"),
                 *(REPO / "peft_pretraining").rglob("*.py")]:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        imported = imported_tools(path.read_text(), names - {module})
        if imported:
            offenders[module] = sorted(imported)
    assert not offenders, offenders


# The library: what the tools, the studies and the trainer share. The study's analyses (utils/study/analyse.py) once
# ran the analysis tools' command lines; they now call utils/instruments/measure.measure_model.
LIBRARY_PACKAGES = ("utils/study", "utils/instruments", "peft_pretraining")


def test_no_library_module_imports_a_tool_or_a_study_script():
    names = tools()
    assert {"layer_remove", "utils.depth_report", "utils.compare_norms", "utils.depth_sweep"} <= names
    # utils/'s top level holds tools only; the modules they share live in the rooms (utils/instruments, utils/study)
    assert {module_name(path) for path in SCRIPT_FILES if path.parent == REPO / "utils"} <= names
    offenders = {}
    for package in LIBRARY_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            imported = imported_tools(path.read_text(), names)
            if imported:
                offenders[str(path.relative_to(REPO))] = sorted(imported)
    assert offenders == {}
    before = "def analyse():\n    import layer_remove\n    from utils import angular_analysis, depth_report\n"
    assert imported_tools(before, names) == {"layer_remove", "utils.angular_analysis", "utils.depth_report"}


def test_the_import_check_sees_both_import_forms():
    names = {"utils.width_sweep", "layer_remove"}
    assert imported_tools("from utils import width_sweep\nimport os", names) == {"utils.width_sweep"}
    assert imported_tools("def f():\n    import layer_remove", names) == {"layer_remove"}
    assert imported_tools("from utils.width_sweep import run_specs", names) == {"utils.width_sweep"}
    assert not imported_tools("from utils.study import runs", names)


def test_pyproject_lists_every_package_of_the_repository():
    """A package missing from pyproject.toml's list is left out of a built wheel (an editable install still finds it,
    so nothing else would notice)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for top in ("peft_pretraining", "utils")
             for init in (REPO / top).rglob("__init__.py")}
    assert found == listed

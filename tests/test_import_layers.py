"""The library packages import no tool and no study script: the scripts import the library, never the reverse."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LIBRARY_PACKAGES = ("utils/study", "utils/instruments", "peft_pretraining")


def script_modules() -> set[str]:
    """The tools and study scripts: the modules at the repository root and directly in utils/ that run as a
    command (`if __name__ == "__main__"`), by their import names."""
    scripts = set()
    for path in [*REPO_ROOT.glob("*.py"), *(REPO_ROOT / "utils").glob("*.py")]:
        if "__name__" in path.read_text() and "__main__" in path.read_text():
            scripts.add(".".join(path.relative_to(REPO_ROOT).with_suffix("").parts))
    return scripts


def imported_modules(path: Path, root: Path = REPO_ROOT) -> set[str]:
    """Every module an import statement of the file may name, at any depth (imports inside functions too):
    for `from X import a`, both X and X.a."""
    package = ".".join(path.relative_to(root).parent.parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_scripts_are_found():
    scripts = script_modules()
    assert {"layer_remove", "torchrun_main", "utils.depth_report", "utils.variance_analysis",
            "utils.angular_analysis", "utils.jacobian_analysis", "utils.compare_norms", "utils.depth_sweep"} <= scripts
    assert "utils.model_io" not in scripts  # a library module that lives in utils/


def test_imports_are_read_at_every_depth_and_relative(tmp_path):
    package = tmp_path / "utils" / "study"
    package.mkdir(parents=True)
    source = package / "example.py"
    source.write_text("def f():\n    from utils import depth_report\n    from .. import angular_analysis\n"
                      "    import layer_remove\n")
    assert {"utils.depth_report", "utils.angular_analysis", "layer_remove"} <= imported_modules(source, tmp_path)


def test_no_library_module_imports_a_tool_or_a_study_script():
    scripts = script_modules()
    offending = {}
    for package in LIBRARY_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            bad = sorted(imported_modules(path) & scripts)
            if bad:
                offending[str(path.relative_to(REPO_ROOT))] = bad
    assert offending == {}

"""Every entry point's bad flag is one line naming it: no usage block, exit code 2."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from peft_pretraining.cli import OneLineErrorParser

REPO = Path(__file__).resolve().parent.parent
ENTRY_POINTS = sorted(["peft_pretraining.args_utils", "layer_remove",
                       *(f"utils.{path.stem}" for path in (REPO / "utils").glob("*.py")
                         if "def build_parser" in path.read_text())])


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

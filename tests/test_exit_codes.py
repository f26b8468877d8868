"""ExitCode is the single source of the trainer's exit codes: the table in docs/training.md#exit-codes lists each
member, with its value, in order."""
import re
from pathlib import Path

from peft_pretraining.exit_codes import ExitCode

DOCS = Path(__file__).resolve().parent.parent / "docs" / "training.md"


def test_the_docs_exit_code_table_lists_every_exit_code_in_order():
    section = DOCS.read_text().split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", section, flags=re.MULTILINE)
    assert [(int(value), name) for value, name in rows] == [(code.value, code.name) for code in ExitCode]

"""The registry of committed studies (utils/study/registry.py): it names every committed report, each study's
command writes the report it claims, the docs' command list is built from it, and a report with no records is one
line and a non-zero exit rather than an empty report."""
from __future__ import annotations

import shlex

import pytest

from peft_pretraining.exit_codes import ExitCode
from utils import compare_norms, depth_sweep, width_sweep
from utils.study import registry

SCRIPTS = {"utils/compare_norms.py": compare_norms, "utils/depth_sweep.py": depth_sweep,
           "utils/width_sweep.py": width_sweep}
TRAINED = [study for study in registry.STUDIES if not study.derived]


def test_every_committed_report_is_a_registered_study():
    """A report committed under docs/ that no row names would be skipped by the rebuild and the docs' list."""
    registered = {study.report for study in registry.STUDIES}
    assert registry.committed_reports() - registered == set()
    assert registered - registry.committed_reports() == set(), "a row names a report that is not committed"


def test_names_are_unique():
    assert len(registry.BY_NAME) == len(registry.STUDIES)


@pytest.mark.parametrize("study", TRAINED, ids=[study.name for study in TRAINED])
def test_a_studys_command_writes_the_report_its_row_names(study, monkeypatch):
    """Parsed as --report_only parses it (no corpus needed), the command resolves to the row's folder and report."""
    monkeypatch.setattr("utils.study.cli.cuda_available", lambda: True)  # the GPU study's records report anywhere
    argv = shlex.split(study.command)
    args = SCRIPTS[argv[1]].parse_args([*argv[2:], "--report_only"])
    assert (registry.REPO / args.out).resolve() == registry.REPO / study.folder  # --out is from the repository root
    assert f"report{args.settings.get('report_suffix', '')}.md" == study.report.rsplit("/", 1)[1]


def test_a_derived_study_reads_only_registered_folders_written_before_it():
    written: set[str] = set()
    for study in registry.STUDIES:
        if study.derived:
            folders = {word for word in shlex.split(study.command) if word.startswith("docs/")}
            assert folders <= written, f"{study.name} reads a folder no earlier row writes"
        written.add(study.folder)


def test_the_studies_page_lists_the_registry(capsys):
    """docs/studies.md's command list is the registry's, so neither drifts; --check names a stale page."""
    assert registry.main(["markdown", "--check"]) == 0
    assert registry.page_block(registry.STUDIES_PAGE.read_text()) == registry.markdown()
    stale = registry.with_block(registry.STUDIES_PAGE.read_text()).replace("# wikipedia_2400", "# renamed")
    assert registry.page_block(stale) != registry.markdown()


def test_show_prints_the_command_and_an_unknown_name_is_one_line(capsys):
    assert registry.main(["show", "wikipedia_2400"]) == 0
    assert capsys.readouterr().out.strip() == registry.BY_NAME["wikipedia_2400"].command
    with pytest.raises(SystemExit) as stop:
        registry.main(["show", "wikipedia_9999"])
    assert stop.value.code == 2
    assert "no committed study is named 'wikipedia_9999'" in capsys.readouterr().err


def test_train_refuses_a_derived_study_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        registry.main(["train", "wikipedia_budget_map"])
    assert stop.value.code == 2
    assert "trains nothing" in capsys.readouterr().err


def test_rebuild_runs_the_command_with_report_only(monkeypatch):
    ran = []
    monkeypatch.setattr(registry.subprocess, "run", lambda argv, **_: ran.append(argv) or type("R", (), {
        "returncode": 0})())
    assert registry.main(["rebuild", "wikipedia_2400", "wikipedia_budget_map"]) == 0
    assert ran[0][1:] == ["utils/depth_sweep.py", *shlex.split(registry.BY_NAME["wikipedia_2400"].command)[2:],
                          "--report_only"]
    assert ran[1][1:] == shlex.split(registry.BY_NAME["wikipedia_budget_map"].command)[1:]


def test_a_report_with_no_records_is_one_line_and_a_non_zero_exit(tmp_path, capsys):
    """Issue 66: `--report_only` under settings nothing was trained with wrote "Partial: 0 of 24 runs" and exited 0."""
    with pytest.raises(SystemExit) as stop:
        depth_sweep.main(["--budget", "wikipedia", "--report_only", "--out", str(tmp_path / "report")])
    assert stop.value.code == ExitCode.BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no record" in err and "registry list" in err
    assert not (tmp_path / "report").exists()


def test_the_one_study_command_checks_and_names_a_bad_study(capsys):
    """Issue 80: `python -m utils.study check` passes on the committed tree; a study that does not exist is one
    line that names it, and nothing is rebuilt."""
    from utils.study.__main__ import main as study_main

    assert study_main(["check"]) == 0
    with pytest.raises(SystemExit) as stopped:
        study_main(["report", "no_such_study"])
    assert stopped.value.code == 2 and "'no_such_study'" in capsys.readouterr().err

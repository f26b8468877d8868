"""The committed studies, one row each: the name a user types, the command that made the report, and the report it
writes. `.ci/rebuild_reports` and the command list in docs/studies.md are built from these rows, and a test fails
when a committed report is missing from them.

    python -m utils.study.registry list                   # every committed study: name, report, command
    python -m utils.study.registry show wikipedia_2400    # the command that trained it
    python -m utils.study.registry train wikipedia_2400 --max_hours 2   # run it (resumes; extra flags pass through)
    python -m utils.study.registry rebuild [NAME ...]     # rewrite reports from their records (default: all)
    python -m utils.study.registry markdown [--check]     # the command list of docs/studies.md

A study's command trains with the study script; the same command with --report_only rewrites its report from the
records under `<folder>/runs/`. A derived study (a learning-rate grid, the budget map, a replication) reads other
studies' folders and trains nothing, so its command is run as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

from peft_pretraining.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[2]
STUDIES_PAGE = REPO / "docs/studies.md"
BLOCK_START, BLOCK_END = "<!-- registry:start -->", "<!-- registry:end -->"


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    command: str  # from the repository root, as a user types it
    report: str  # the report file the command writes, relative to the repository root
    group: str  # the heading the docs' command list files it under
    derived: bool = False  # reads other studies' folders; trains nothing

    @property
    def folder(self) -> str:
        return str(Path(self.report).parent)

    def rebuild_argv(self) -> list[str]:
        argv = shlex.split(self.command)
        return argv if self.derived else argv + ["--report_only"]


CPU_STUDY = "the CPU-scale study and the rivals"
DEPTH = "the depth sweep"
WIDTH = "the width sweep"
WIKIPEDIA = "the Wikipedia depth sweep: the pilot, its learning-rate grid, the 3-seed sweep"
BUDGET_MAP = ("the budget x depth map: the 2,400- and 5,000-update budgets, then the map over them and the "
              "10,500-update sweep, with the latter's learning-rate grid, and what LNS is worth in compute there")
MULTIPLIER = ("what LNS is worth in compute (issue 79): the 2,400-update rate grid at seed 1, L = 6 and 24, each run's "
              "selection loss on text no verdict reads")
SECOND_HOST = "the float32 depth sweep and long study trained again on an AVX2 host, and what survived the change"

WIKIPEDIA_PILOT = "python utils/depth_sweep.py --budget wikipedia_pilot --dtype float32 --no-compile"
# In the order they rebuild: a derived study after the folders it reads.
STUDIES = (
    Study("study", "python utils/compare_norms.py --dtype float32 --no-compile", "docs/study/report.md", CPU_STUDY),
    Study("rivals", "python utils/compare_norms.py --budget rivals --dtype float32 --no-compile",
          "docs/study/report_rivals.md", CPU_STUDY),
    Study("rivals_2026", "python utils/compare_norms.py --budget rivals_2026 --dtype float32 --no-compile",
          "docs/study/report_rivals_2026.md", CPU_STUDY),
    Study("study_long", "python utils/compare_norms.py --budget long --dtype float32 --no-compile",
          "docs/study_long/report.md", CPU_STUDY),
    Study("study_mixed", "python utils/compare_norms.py --dtype mixed --compile",
          "docs/study_mixed_compile/report.md", CPU_STUDY),
    Study("study_long_mixed", "python utils/compare_norms.py --budget long --dtype mixed --compile",
          "docs/study_long_mixed_compile/report.md", CPU_STUDY),
    Study("long_rivals", "python utils/compare_norms.py --budget long_rivals --dtype mixed --compile",
          "docs/study_long_mixed_compile/report_rivals.md", CPU_STUDY),
    Study("long_rivals_2026", "python utils/compare_norms.py --budget long_rivals_2026 --dtype mixed --compile",
          "docs/study_long_mixed_compile/report_rivals_2026.md", CPU_STUDY),
    Study("depth_sweep", "python utils/depth_sweep.py --dtype float32 --no-compile", "docs/depth_sweep/report.md",
          DEPTH),
    Study("depth_sweep_mixed", "python utils/depth_sweep.py --dtype mixed --compile",
          "docs/depth_sweep_mixed_compile/report.md", DEPTH),
    Study("depth_sweep_rivals", "python utils/depth_sweep.py --budget rivals --dtype mixed --compile",
          "docs/depth_sweep_mixed_compile/report_rivals.md", DEPTH),
    Study("depth_sweep_rivals_2026", "python utils/depth_sweep.py --budget rivals_2026 --dtype mixed --compile",
          "docs/depth_sweep_mixed_compile/report_rivals_2026.md", DEPTH),
    Study("wikipedia_pilot", WIKIPEDIA_PILOT, "docs/depth_sweep_wikipedia/report_pilot.md", WIKIPEDIA),
    Study("wikipedia_pilot_lr5e-4", f"{WIKIPEDIA_PILOT} --lr 5e-4 --depths 12 24",
          "docs/depth_sweep_wikipedia_lr0.0005/report_pilot.md", WIKIPEDIA),
    Study("wikipedia_pilot_lr2e-3", f"{WIKIPEDIA_PILOT} --lr 2e-3 --depths 6 12 24",
          "docs/depth_sweep_wikipedia_lr0.002/report_pilot.md", WIKIPEDIA),
    Study("wikipedia_pilot_lr4e-3", f"{WIKIPEDIA_PILOT} --lr 4e-3 --depths 6 12 24",
          "docs/depth_sweep_wikipedia_lr0.004/report_pilot.md", WIKIPEDIA),
    Study("wikipedia_pilot_lr8e-3", f"{WIKIPEDIA_PILOT} --lr 8e-3 --depths 6 12 24",
          "docs/depth_sweep_wikipedia_lr0.008/report_pilot.md", WIKIPEDIA),
    Study("wikipedia", "python utils/depth_sweep.py --budget wikipedia --dtype float32 --no-compile --lr 2e-3 "
          "--depths 6 12 24", "docs/depth_sweep_wikipedia_lr0.002/report.md", WIKIPEDIA),
    # LNS's seeds 2-3 at L = 24, where 4e-3 beat 2e-3 for it and not for Pre-LN; seed 1 of the rest is the pilot's
    Study("wikipedia_lr4e-3", "python utils/depth_sweep.py --budget wikipedia --dtype float32 --no-compile --lr 4e-3 "
          "--depths 6 12 24", "docs/depth_sweep_wikipedia_lr0.004/report.md", WIKIPEDIA),
    Study("wikipedia_lr_grid", "python -m utils.study.lr_grid docs/depth_sweep_wikipedia "
          "docs/depth_sweep_wikipedia_lr0.0005 docs/depth_sweep_wikipedia_lr0.002 docs/depth_sweep_wikipedia_lr0.004 "
          "docs/depth_sweep_wikipedia_lr0.008", "docs/depth_sweep_wikipedia_lr_grid/lr_grid.md", WIKIPEDIA,
          derived=True),
    Study("wikipedia_2400", "python utils/depth_sweep.py --budget wikipedia_2400 --dtype float32 --no-compile "
          "--lr 2e-3", "docs/depth_sweep_wikipedia_2400_lr0.002/report.md", BUDGET_MAP),
    Study("wikipedia_5000", "python utils/depth_sweep.py --budget wikipedia_5000 --dtype float32 --no-compile "
          "--lr 2e-3", "docs/depth_sweep_wikipedia_5000_lr0.002/report.md", BUDGET_MAP),
    Study("wikipedia_budget_map", "python -m utils.study.budget_map docs/depth_sweep_wikipedia_2400_lr0.002 "
          "docs/depth_sweep_wikipedia_5000_lr0.002 docs/depth_sweep_wikipedia_lr0.002 "
          "--grid docs/depth_sweep_wikipedia docs/depth_sweep_wikipedia_lr0.004 docs/depth_sweep_wikipedia_lr0.008",
          "docs/depth_sweep_wikipedia_budget_map/budget_map.md", BUDGET_MAP,
          derived=True),
    Study("wikipedia_1200", "python utils/depth_sweep.py --budget wikipedia_1200 --dtype float32 --no-compile "
          "--lr 2e-3", "docs/depth_sweep_wikipedia_1200_lr0.002/report.md", BUDGET_MAP),
    Study("compute_multiplier", "python -m utils.study.multiplier docs/depth_sweep_wikipedia_1200_lr0.002 "
          "docs/depth_sweep_wikipedia_2400_lr0.002 docs/depth_sweep_wikipedia_5000_lr0.002 "
          "docs/depth_sweep_wikipedia_lr0.002",
          "docs/compute_multiplier/multiplier.md", BUDGET_MAP, derived=True),
    Study("wikipedia_2400_lr1e-3", "python utils/depth_sweep.py --budget wikipedia_2400 --dtype float32 --no-compile "
          "--lr 1e-3 --depths 6 24 --seeds 1", "docs/depth_sweep_wikipedia_2400/report.md", MULTIPLIER),
    Study("wikipedia_2400_lr4e-3", "python utils/depth_sweep.py --budget wikipedia_2400 --dtype float32 --no-compile "
          "--lr 4e-3 --depths 6 24 --seeds 1", "docs/depth_sweep_wikipedia_2400_lr0.004/report.md", MULTIPLIER),
    Study("wikipedia_2400_lr8e-3", "python utils/depth_sweep.py --budget wikipedia_2400 --dtype float32 --no-compile "
          "--lr 8e-3 --depths 6 24 --seeds 1", "docs/depth_sweep_wikipedia_2400_lr0.008/report.md", MULTIPLIER),
    # 2e-3 trained again at seed 1 on an AVX2 host (the committed runs' checkpoints were gone), for its selection
    # losses; the verdicts keep reading the committed 2e-3 records
    Study("wikipedia_2400_lr2e-3_avx2", "python utils/depth_sweep.py --budget wikipedia_2400 --dtype float32 "
          "--no-compile --lr 2e-3 --depths 6 24 --seeds 1 --out docs/depth_sweep_wikipedia_2400_lr0.002_avx2 "
          "--runs_dir runs/depth_sweep_wikipedia_2400_lr0.002_avx2",
          "docs/depth_sweep_wikipedia_2400_lr0.002_avx2/report.md", MULTIPLIER),
    Study("wikipedia_2400_rate_choice", "python -m utils.study.rate_choice report docs/depth_sweep_wikipedia_2400 "
          "docs/depth_sweep_wikipedia_2400_lr0.002_avx2 docs/depth_sweep_wikipedia_2400_lr0.004 "
          "docs/depth_sweep_wikipedia_2400_lr0.008",
          "docs/depth_sweep_wikipedia_2400_rate_choice/rate_choice.md",
          MULTIPLIER, derived=True),
    Study("depth_sweep_avx2", "python utils/depth_sweep.py --dtype float32 --no-compile --out docs/depth_sweep_avx2",
          "docs/depth_sweep_avx2/report.md", SECOND_HOST),
    Study("depth_sweep_replication", "python -m utils.study.replicate docs/depth_sweep docs/depth_sweep_avx2",
          "docs/depth_sweep_avx2/replication.md", SECOND_HOST, derived=True),
    Study("study_long_avx2", "python utils/compare_norms.py --budget long --dtype float32 --no-compile "
          "--out docs/study_long_avx2", "docs/study_long_avx2/report.md", SECOND_HOST),
    Study("study_long_replication", "python -m utils.study.replicate docs/study_long docs/study_long_avx2",
          "docs/study_long_avx2/replication.md", SECOND_HOST, derived=True),
    Study("width_sweep", "python utils/width_sweep.py --dtype mixed --compile",
          "docs/width_sweep_mixed_compile/report.md", WIDTH),
    # its records name the GPU machine's run folder, so the rebuild names it too
    Study("width_sweep_gpu", "python utils/width_sweep.py --budget gpu --device cuda --no-compile --widths 512 768 "
          "1024 --runs_dir /tmp/width_runs --dtype mixed", "docs/width_sweep_mixed_cuda/report_gpu.md", WIDTH),
)
BY_NAME = {study.name: study for study in STUDIES}


def committed_reports() -> set[str]:
    """Every report file committed under docs/ that a study writes (a report folder's report*.md, a grid, a map, a
    replication, a multiplier or a rate choice), relative to the repository root."""
    patterns = ("report*.md", "lr_grid.md", "budget_map.md", "replication.md", "multiplier.md", "rate_choice.md")
    return {str(path.relative_to(REPO)) for pattern in patterns for path in REPO.glob(f"docs/*/{pattern}")}


def markdown() -> str:
    """docs/studies.md's command list: every study under its group, in rebuild order."""
    lines, group = ["```bash"], None
    for study in STUDIES:
        if study.group != group:
            group = study.group
            lines.append(f"# {group}")
        lines.append(f"{study.command}   # {study.name}")
    return "\n".join(lines + ["# the README's results table, from the summaries the lines above write",
                              "python -m utils.study.results_table", "```"])


def page_block(text: str) -> str:
    start, end = text.index(BLOCK_START) + len(BLOCK_START), text.index(BLOCK_END)
    return text[start:end].strip()


def with_block(text: str) -> str:
    start, end = text.index(BLOCK_START) + len(BLOCK_START), text.index(BLOCK_END)
    return f"{text[:start]}\n{markdown()}\n{text[end:]}"


def rebuild(studies: list[Study]) -> int:
    for study in studies:
        argv = study.rebuild_argv()
        print("+", shlex.join(argv), flush=True)
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, stdout=subprocess.DEVNULL)
        if done.returncode:
            print(f"registry: rebuilding {study.name} failed with exit code {done.returncode}", file=sys.stderr)
            return done.returncode
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every committed study: name, report, command")
    actions.add_parser("folders", help="every committed report folder, one a line")
    actions.add_parser("show", help="the command that made a study's report").add_argument("name")
    train = actions.add_parser("train", help="run a study's command (it resumes; extra flags pass through)")
    train.add_argument("name")
    rebuild_action = actions.add_parser("rebuild", help="rewrite reports from their records")
    rebuild_action.add_argument("names", nargs="*", help="studies to rebuild (default: all, in order)")
    page = actions.add_parser("markdown", help="write the command list of docs/studies.md")
    page.add_argument("--check", action="store_true", help="fail if docs/studies.md's list differs")
    return parser


def find(parser: argparse.ArgumentParser, name: str) -> Study:
    if name not in BY_NAME:
        parser.error(f"no committed study is named {name!r}; `python -m utils.study.registry list` lists them")
    return BY_NAME[name]


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.action != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.action == "list":
        for study in STUDIES:
            print(f"{study.name:24} {study.report}\n{'':24} {study.command}")
    elif args.action == "folders":
        print("\n".join(dict.fromkeys(study.folder for study in STUDIES)))
    elif args.action == "show":
        print(find(parser, args.name).command)
    elif args.action == "train":
        study = find(parser, args.name)
        if study.derived:
            parser.error(f"{study.name} trains nothing (it reads other studies' folders); rebuild it instead")
        argv = shlex.split(study.command) + extra
        print("+", shlex.join(argv), flush=True)
        return subprocess.run([sys.executable, *argv[1:]], cwd=REPO).returncode
    elif args.action == "rebuild":
        return rebuild([find(parser, name) for name in args.names] or list(STUDIES))
    elif args.check:
        if page_block(STUDIES_PAGE.read_text()) != markdown():
            print(f"{STUDIES_PAGE.relative_to(REPO)}: its command list is stale; "
                  "python -m utils.study.registry markdown rewrites it", file=sys.stderr)
            return ExitCode.BAD_INPUT
    else:
        STUDIES_PAGE.write_text(with_block(STUDIES_PAGE.read_text()))
        print(STUDIES_PAGE.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())

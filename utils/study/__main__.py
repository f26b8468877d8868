"""One command for the studies (issue 80):

    python -m utils.study list               # every committed study: its name, report and command
    python -m utils.study train NAME [FLAGS] # run a study's command (it resumes; FLAGS pass through)
    python -m utils.study report NAME|all    # rewrite reports from their records, then the README and study pages
    python -m utils.study check              # exit 1 where the README, a study page or docs/studies.md is stale

`report` and `check` read only committed records and summaries: they train nothing. The scripts
(utils/compare_norms.py, utils/depth_sweep.py, utils/width_sweep.py) stay the entry points of a study's own flags.
"""
from __future__ import annotations

import argparse
import sys

from peft_pretraining.cli import OneLineErrorParser
from utils.study import pages, registry, results_table


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True, parser_class=OneLineErrorParser)
    actions.add_parser("list", help="every committed study: name, report, command")
    actions.add_parser("train", help="run a study's command (extra flags pass through)").add_argument("name")
    report = actions.add_parser("report", help="rewrite reports from their records, then the README and pages")
    report.add_argument("names", nargs="+", help="study names, or all")
    actions.add_parser("check", help="exit 1 where a rendered README block, study page or command list is stale")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and args.action != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.action == "list":
        return registry.main(["list"])
    if args.action == "train":
        return registry.main(["train", args.name, *extra])
    if args.action == "report":
        names = [] if args.names == ["all"] else args.names
        for name in names:
            if name not in registry.BY_NAME:
                parser.error(f"report: no committed study is named {name!r}; `python -m utils.study list` lists them")
        return (registry.main(["rebuild", *names]) or results_table.main([]) or pages.main([])
                or registry.main(["markdown"]))
    return max(results_table.main(["--check"]), pages.main(["--check"]), registry.main(["markdown", "--check"]))


if __name__ == "__main__":
    sys.exit(main())

"""The documentation stays true to the code.

- Every relative link (and image) in README.md, data/README.md and docs/**/*.md points to a file that exists, and an
  anchor, when given, names a heading of the target page (GitHub's heading slugs).
- Every flag in a documented command that runs one of our scripts is accepted by that script's argparse parser.
  The parser is built with the script's `build_parser()` and only parses: nothing is run, loaded or written.
- Every `--flag` named in code (a span or a fenced block), also outside a command (flag tables, prose), is a flag of
  one of our scripts or of a named outside tool, so a renamed or removed flag cannot linger in a table.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import io
import re
import shlex
import unicodedata
import urllib.parse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A script whose parser lives in another module: the trainer, and the documented `python -m peft_pretraining.X`
# commands, entry points that run a module of peft_pretraining/data/.
PARSER_MODULE = {"torchrun_main.py": "peft_pretraining.training.args_utils",
                 "peft_pretraining.dataloader": "peft_pretraining.data.embedded_corpus",
                 "peft_pretraining.wikipedia_corpus": "peft_pretraining.data.wikipedia_corpus",
                 "peft_pretraining.lm_eval_tasks": "peft_pretraining.data.lm_eval_tasks"}
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
LAUNCHER_PREFIXES = ("do", "then", "else", "time", "exec", "env", "nohup")
PLACEHOLDER = re.compile(r"\$")
ANGLE_PLACEHOLDER = re.compile(r"<[A-Za-z][\w.-]*>")  # <step>, not a redirection
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {";", "&&", "||", "|", "&", "(", ")", ";;"}
REDIRECTIONS = {">", ">>", "<", ">&", "<&", "&>"}


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "data" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ----------------------------------------------------------------------------------------------------------------
# Markdown structure: fenced blocks, inline code, headings
# ----------------------------------------------------------------------------------------------------------------
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """(prose lines, fenced blocks): prose as (line number, text); blocks as (first line number, language, body)."""
    prose, blocks = [], []
    fence, language, start, body = None, "", 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, language, start, body = match.group(1), match.group(2).lower(), number + 1, []
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((start, language, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append((number, line))
    return prose, blocks


INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def strip_inline_code(line: str) -> str:
    return INLINE_CODE.sub("", line)


def heading_text(markdown: str) -> str:
    """The rendered text of a heading: code spans keep their content, links keep their text, markup goes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("**", "").replace("*", "").strip()


def github_slug(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation and symbols dropped, each space a hyphen."""
    kept = []
    for char in text.lower():
        category = unicodedata.category(char)
        if char in " -_" or category[0] in "LNM":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose:
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(heading_text(match.group(1)))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
        for name in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line):
            result.add(name)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Links
# ----------------------------------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_LINK = re.compile(r"(?:src|href)=\"([^\"]+)\"")


def link_errors(path: Path) -> list[str]:
    prose, _ = split_fences(path.read_text())
    errors = []
    for number, line in prose:
        line = strip_inline_code(line)
        targets = LINK.findall(line) + HTML_LINK.findall(line) + REFERENCE_DEFINITION.findall(line)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path
            where = f"{shown(path)}:{number}: {target}"
            if not resolved.exists():
                errors.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and urllib.parse.unquote(anchor) not in anchors(resolved):
                errors.append(f"{where}: no heading with the anchor #{anchor}")
    return errors


# ----------------------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------------------
def shell_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command line) of every fenced shell block and every inline code span that runs a script."""
    prose, blocks = split_fences(path.read_text())
    commands = []
    for start, language, body in blocks:
        if language not in SHELL_LANGUAGES:
            continue
        joined, first = "", None
        for offset, line in enumerate(body.splitlines()):
            line = re.sub(r"^\s*\$ ", "", line)
            first = start + offset if first is None else first
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            commands.append((first, joined + line))
            joined, first = "", None
        if joined:
            commands.append((first, joined))
    for number, paragraph in paragraphs(prose):  # an inline code span may wrap onto the next line
        for match in INLINE_CODE.finditer(paragraph):
            commands.append((number, match.group(2)))
    return commands


def paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Consecutive non-blank prose lines joined with spaces, each with its first line number."""
    result, previous = [], None
    for number, line in prose:
        if line.strip() and previous == number - 1 and result:
            result[-1] = (result[-1][0], result[-1][1] + " " + line.strip())
        elif line.strip():
            result.append((number, line.strip()))
        previous = number if line.strip() else None
    return result


def split_segments(command: str) -> list[list[str]]:
    """Simple commands of a shell line: split at ; && || | & and parentheses; comments and redirections dropped."""
    command = ANGLE_PLACEHOLDER.sub("$PLACEHOLDER", command)
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: prose, not a command
        return []
    segments, current, skip_next = [], [], False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif token in OPERATORS:
            segments.append(current)
            current = []
        elif token in REDIRECTIONS:
            skip_next = True
        else:
            current.append(token)
    segments.append(current)
    return [segment for segment in segments if segment]


def script_invocation(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(module that builds the parser, the script's arguments), or None when the command runs none of our scripts."""
    tokens = list(tokens)
    while tokens and (tokens[0] in LAUNCHER_PREFIXES or ENV_ASSIGNMENT.match(tokens[0])):
        tokens.pop(0)
    if tokens[:1] == ["timeout"] and len(tokens) > 1:
        tokens = tokens[2:]
    if not tokens:
        return None
    program = tokens[0]
    if program in ("python", "python3") and tokens[1:2] == ["-m"] and len(tokens) > 2:
        if tokens[2] in ("torch.distributed.run", "torch.distributed.launch"):
            return _torchrun(tokens[3:])
        module_path = REPO / (tokens[2].replace(".", "/") + ".py")
        return (PARSER_MODULE.get(tokens[2], tokens[2]), tokens[3:]) if module_path.is_file() else None
    if program in ("python", "python3") and len(tokens) > 1 and tokens[1].endswith(".py"):
        return _script(tokens[1], tokens[2:])
    if program == "torchrun":
        return _torchrun(tokens[1:])
    if program in ("bash", "sh") and tokens[1:2] == ["utils/gpu/gpu_check.sh"]:  # a wrapper of utils/gpu/gpu_check.py
        return "utils.gpu.gpu_check", tokens[2:]
    if program in ("bash", "sh") and tokens[1:3] == ["utils/gpu/gpu_lease.sh", "check"]:  # OUT, then gpu_check's flags
        return "utils.gpu.gpu_check", tokens[3:]
    if program in ("bash", "sh") and len(tokens) > 1 and re.fullmatch(r"(\./)?run_\w+\.sh", tokens[1]):
        return _run_script(tokens[1], tokens[2:])
    if re.fullmatch(r"\./run_\w+\.sh", program):
        return _run_script(program, tokens[1:])
    return None


def _script(script: str, arguments: list[str]) -> tuple[str, list[str]]:
    script = script.removeprefix("./")
    module = PARSER_MODULE.get(script, script.removesuffix(".py").replace("/", "."))
    return module, arguments


def _torchrun(tokens: list[str]) -> tuple[str, list[str]] | None:
    for index, token in enumerate(tokens):
        if token.endswith(".py"):
            return _script(token, tokens[index + 1:])
    return None


def _run_script(script: str, tokens: list[str]) -> tuple[str, list[str]]:
    """run_*.sh NORM_TYPE [POST_NUM] [flags for torchrun_main.py]: the positionals are checked as the flags they set."""
    if not (REPO / script).is_file():
        return script, tokens  # reported as a missing script
    arguments, tokens = [], [token for token in tokens if token not in ("...", "…")]
    if tokens and not tokens[0].startswith("-"):
        arguments += ["--norm_type", tokens.pop(0)]
        if tokens and tokens[0].isdigit():
            arguments += ["--post_num", tokens.pop(0)]
    return PARSER_MODULE["torchrun_main.py"], arguments + tokens


class FlagError(Exception):
    pass


def _raise(message):
    raise FlagError(message)


def strict_parser(module_name: str) -> argparse.ArgumentParser:
    """The script's own parser, made to raise instead of exit, with no abbreviations and no required flags."""
    module = importlib.import_module(module_name)
    if not hasattr(module, "build_parser"):
        raise FlagError(f"{module_name} has no build_parser(); the docs test cannot check its flags")
    parser = copy.deepcopy(module.build_parser())
    pending = [parser]
    while pending:
        current = pending.pop()
        current.error = _raise
        current.allow_abbrev = False
        for action in current._actions:
            if action.option_strings:
                action.required = False  # examples may leave out what another example shows
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return parser


def substitute_placeholders(parser: argparse.ArgumentParser, arguments: list[str]) -> list[str]:
    """`$VAR` (and `<step>`, made `$PLACEHOLDER` by the lexer) stands for a value: give it one its flag accepts.

    `...` stands for more flags and goes.
    """
    result = []
    for token in arguments:
        if token in ("...", "…"):
            continue
        if PLACEHOLDER.search(token):
            action = parser._option_string_actions.get(result[-1]) if result else None
            token = _stand_in(action)
        result.append(token)
    return result


def _stand_in(action) -> str:
    if action is not None and action.choices:
        return str(next(iter(action.choices)))
    for candidate in ("1", "placeholder"):
        try:
            if action is None or action.type is None or action.type(candidate) is not None:
                return candidate
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            continue
    return "placeholder"


def flag_errors(path: Path) -> list[str]:
    errors = []
    for number, command in shell_commands(path):
        for tokens in split_segments(command):
            invocation = script_invocation(tokens)
            if invocation is None:
                continue
            module_name, arguments = invocation
            where = f"{shown(path)}:{number}: {' '.join(tokens)}"
            if module_name.endswith(".sh"):
                errors.append(f"{where}: no such script {module_name}")
                continue
            try:
                parser = strict_parser(module_name)
                with contextlib.redirect_stdout(io.StringIO()):  # --help prints, then exits with 0
                    parser.parse_args(substitute_placeholders(parser, arguments))
            except ModuleNotFoundError as error:
                errors.append(f"{where}: cannot import {module_name} ({error})")
            except FlagError as error:
                errors.append(f"{where}: {error}")
            except SystemExit as error:
                if error.code:
                    errors.append(f"{where}: exit {error.code}")
    return errors


# ----------------------------------------------------------------------------------------------------------------
# Flags named outside a command
# ----------------------------------------------------------------------------------------------------------------
# Flags of tools that are not ours, shown in the docs: torchrun's rendezvous, lm-eval's CLI, pytest, SLURM's sbatch,
# and the reference code's own flags quoted in docs/differences.md.
OUTSIDE_FLAGS = {
    "--nnodes", "--nproc_per_node", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--standalone",  # torchrun
    "--model", "--model_args", "--include_path", "--tasks", "--limit",  # lm_eval
    "--durations",  # pytest
    "--gres", "--time", "--requeue", "--signal",  # SLURM's sbatch
    "--no-deps",  # pip
    "--beta1", "--use_hf_model", "--name",  # the reference code
}
FLAG_NAME = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


@functools.lru_cache(maxsize=None)
def our_flags() -> frozenset[str]:
    """Every option string of every parser in the repository (each script with a build_parser())."""
    flags = set()
    scripts = [*REPO.glob("*.py"), *(REPO / "utils").rglob("*.py"), *(REPO / "peft_pretraining").rglob("*.py")]
    for script in sorted(scripts):
        if "def build_parser" not in script.read_text():
            continue
        module = ".".join(script.relative_to(REPO).with_suffix("").parts)
        pending = [importlib.import_module(module).build_parser()]
        while pending:
            parser = pending.pop()
            for action in parser._actions:
                flags.update(action.option_strings)
                if isinstance(action, argparse._SubParsersAction):
                    pending.extend(action.choices.values())
    return frozenset(flags)


def unknown_flag_errors(path: Path) -> list[str]:
    prose, blocks = split_fences(path.read_text())
    code = [(number, match.group(2)) for number, paragraph in paragraphs(prose)
            for match in INLINE_CODE.finditer(paragraph)]
    code += [(start + offset, line) for start, _, body in blocks for offset, line in enumerate(body.splitlines())]
    known = our_flags() | OUTSIDE_FLAGS
    return [f"{shown(path)}:{number}: {flag} is a flag of none of our scripts"
            for number, text in code for flag in FLAG_NAME.findall(text) if flag not in known]


# ----------------------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", doc_files(), ids=shown)
def test_relative_links_resolve(path):
    assert link_errors(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=shown)
def test_documented_flags_are_accepted(path):
    assert flag_errors(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=shown)
def test_every_flag_named_in_the_docs_exists(path):
    assert unknown_flag_errors(path) == []


def test_unknown_flag_checker(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n| flag | default |\n|---|---|\n| `--keep_last N` | all |\n"
                    "| `--keep_newest N` | all |\n\n"
                    "```bash\ntorchrun --nproc_per_node 2 torchrun_main.py --batch_size 4"
                    "  # --not_a_flag_anywhere\n```\n"
                    "Prose --outside_code is not checked.\n")
    errors = unknown_flag_errors(page)
    assert len(errors) == 2
    assert "--keep_newest" in errors[0] and "--not_a_flag_anywhere" in errors[1]


def test_the_docs_show_commands_that_get_checked():
    checked = [invocation for path in doc_files() for _, command in shell_commands(path)
               for tokens in split_segments(command) if (invocation := script_invocation(tokens))]
    modules = {module for module, _ in checked}
    assert {"peft_pretraining.training.args_utils", "layer_remove", "utils.angular_analysis",
            "utils.finetune"} <= modules


def test_readme_keeps_the_commands_ci_reads():
    readme = (REPO / "README.md").read_text()
    assert "pip install -r exp_requirements.txt" in readme
    assert re.search(r"^pytest\b", readme, re.MULTILINE)


FAKE_PAGE = """# A page

## Run `bash run_tiny.sh LNS` first

```bash
{command}
```
"""


@pytest.mark.parametrize("command", [
    "python utils/angular_analysis.py --model_path runs/x --num_tokenz 100",
    "bash run_130m.sh LNS 3 --learning_rate 1e-3",
    "torchrun --standalone --nproc_per_node 2 torchrun_main.py --batch_size 4 --bogus_flag 1",
    "python torchrun_main.py --batch 4",  # an abbreviation is not a documented flag
    "python torchrun_main.py --norm_type lnss",
    "HF_HUB_OFFLINE=1 python layer_remove.py --model_path M \\\n    --layer_idx 5",
    "python utils/no_such_tool.py --flag",
    "bash run_13m.sh LNS",
])
def test_checker_catches_a_bad_flag(tmp_path, command):
    page = tmp_path / "page.md"
    page.write_text(FAKE_PAGE.format(command=command))
    assert len(flag_errors(page)) == 1


@pytest.mark.parametrize("command", [
    "python utils/angular_analysis.py --model_path runs/x --num_tokens 100  # a comment --not_a_flag",
    "bash run_130m.sh LNS 3 --dtype mixed --save_dir runs/my130m",
    "NPROC=2 bash run_250m.sh post_pre 6",
    "for run in a b; do python layer_remove.py --model_path runs/$run --layer_index $i; done",
    "torchrun --nnodes 2 --rdzv_endpoint $HEAD:29500 torchrun_main.py --model_config c.json --batch_size 32 ...",
    "python -m peft_pretraining.dataloader build-embedded --source /path/to/austen",
    "python layer_remove.py --model_path runs/<run>/model_<step> --layer_index <i> > log.txt",
    "pip install -r exp_requirements.txt && pytest -q",
])
def test_checker_accepts_good_flags(tmp_path, command):
    page = tmp_path / "page.md"
    page.write_text(FAKE_PAGE.format(command=command))
    assert flag_errors(page) == []


def test_link_checker(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The `--dtype` modes: bf16 & fp32\n\n## Other\n")
    (tmp_path / "figure.png").write_bytes(b"")
    page = tmp_path / "README.md"
    page.write_text(
        "See [ok](docs/other.md), ![fig](figure.png), [anchor](docs/other.md#the---dtype-modes-bf16--fp32),\n"
        "[dup](docs/other.md#other-1), [self](#a-page) and [web](https://example.org/missing).\n"
        "# A page\n"
        "Broken: [gone](docs/gone.md), [bad anchor](docs/other.md#the-dtype-modes).\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
    )
    errors = link_errors(page)
    assert len(errors) == 2
    assert "docs/gone.md: no such file" in errors[0]
    assert "#the-dtype-modes" in errors[1]


def test_github_slug():
    assert github_slug(heading_text("What `bash run_tiny.sh LNS` does")) == "what-bash-run_tinysh-lns-does"
    assert github_slug(heading_text("Layer analyses: angular distance, layer removal")) == \
        "layer-analyses-angular-distance-layer-removal"
    assert github_slug(heading_text("[Linked](x.md) **bold** ℓ + n")) == "linked-bold-ℓ--n"


def test_the_utils_package_docstring_names_every_tool_in_utils():
    """utils/__init__.py is the index of utils/: every module and script there is named in it."""
    import utils

    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.sh)?", utils.__doc__))
    entries = [path for path in (REPO / "utils").iterdir()
               if not path.name.startswith(("_", ".")) and (path.suffix in (".py", ".sh") or path.is_dir())]
    missing = sorted(path.name for path in entries
                     if path.name not in named and not (path.suffix == ".py" and path.stem in named))
    assert not missing, f"utils/__init__.py does not name {', '.join(missing)}"

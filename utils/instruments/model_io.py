"""The one shared helper of the analyses: load a model and tokenizer, feed text, read the residual stream.

- ``load_model_and_tokenizer`` loads a hub id or a local folder. A folder whose config.json has a ``norm_type``
  key is one of our checkpoints and loads with ``peft_pretraining.model.modeling_llama.LlamaForCausalLM``; anything
  else loads with ``AutoModelForCausalLM``.
- ``token_batches`` turns documents (C4 streamed, a local text file, or the embedded held-out novel) into padded
  batches of token windows, stopping after exactly ``num_tokens`` real tokens.
- ``ResidualStream`` runs a batch and returns the residual stream entering decoder layer 0 and leaving every
  decoder layer, captured with forward hooks on the layers. ``output_hidden_states`` is not used because its
  last entry has the final norm applied, which would make the last layer look unlike the others.

Nothing here imports the trainer.
"""
from __future__ import annotations

import gzip
import inspect
import json
import os
import sys
import urllib.request
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable, Iterator

import torch
from torch import nn

from peft_pretraining.data.dataloader import EMBEDDED_DIR, TOKENIZER_DIR, vocab_size_covering
from peft_pretraining.model.model_parts import backbone, decoder_layers, is_our_config
from peft_pretraining.model.modeling_llama import (  # also registers our model type
    LlamaForCausalLM,
    canonical_norm_type,
    norm_type_choices,
)

EMBEDDED_HELDOUT_TEXT = EMBEDDED_DIR / "validation.jsonl.gz"  # the held-out novel, one JSON {"text"} per line
REPO_TOKENIZER = TOKENIZER_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TEXT_SOURCES = ("c4", "embedded")
HUB_STREAM_WINDOW = 256  # residual-stream tools' window for hub models that record no trained length


# ----------------------------------------------------------------------------- devices and dtypes
def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device: {device!r} is not a torch device ({err})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on a GPU and float32 on a CPU."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_run_settings(parser, args) -> tuple[torch.device, torch.dtype, tuple[str, Path | None]]:
    """--device, --dtype and the text source (--dataset / --text_file) of a tool, or a one-line error naming the
    flag."""
    try:
        device = resolve_device(args.device)
        return device, resolve_dtype(args.dtype, device), resolve_text_source(args.dataset, args.text_file)
    except ValueError as err:
        parser.error(str(err))


# ----------------------------------------------------------------------------- loading
def read_local_config(model_path: str | os.PathLike) -> dict | None:
    """The folder's config.json as a dict, None when there is none; ValueError naming the file when it is not a
    JSON object or names a norm_type our model does not know."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object (it holds a {type(config).__name__})")
    if "norm_type" in config:
        try:
            canonical_norm_type(config["norm_type"])  # an alias ("cod") is a known name
        except ValueError:
            raise ValueError(f"{config_file}: unknown norm_type {config['norm_type']!r} (valid: "
                             f"{', '.join(norm_type_choices())})") from None
    return config


def bad_input(parser, message: str):
    """Exit 2 with one line (no usage block): `<tool>: error: <message>`."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def local_path_reason(model_path: str) -> str | None:
    """Why ``model_path`` can only be a local path, or None when it may be a hub id (``name`` or ``owner/name``)."""
    if model_path.startswith(("/", "./", "../", "~")) or model_path in (".", "..") or "\\" in model_path:
        return "it starts with /, ./, ../ or ~"
    parts = model_path.split("/")
    if len(parts) > 2:
        return "a hub id has at most one '/'"
    if len(parts) == 2 and Path(parts[0]).is_dir():
        return f"{parts[0]}/ is a local folder"
    return None


def check_model_path(parser, model_path: str, flag: str = "--model_path") -> None:
    """Before any work: a local folder with a readable config.json, or a model the hub (or its cache) knows.
    Otherwise a one-line error naming `flag` (exit 2)."""
    path = Path(model_path)
    if path.exists():
        try:
            config = read_local_config(path) if path.is_dir() else None
        except ValueError as err:
            bad_input(parser, f"{flag}: {err}")
        if config is None:
            bad_input(parser, f"{flag}: {model_path} is not a model folder (no config.json)")
        return
    local_because = local_path_reason(model_path)
    if local_because:  # asking the hub for it would only retry, for half a minute offline
        bad_input(parser, f"{flag}: {model_path} does not exist (a local path, not a hub id: {local_because})")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        bad_input(parser, f"{flag}: {model_path} is neither a local folder nor a model on the hub ({first_line})")


def load_model(model_path: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"):
    """Load a causal LM from a hub id or a local folder, in eval mode on ``device``.

    ``dtype="auto"`` keeps the dtype the checkpoint was saved in."""
    if is_our_config(read_local_config(model_path) or {}):
        model_class = LlamaForCausalLM
    else:
        from transformers import AutoModelForCausalLM as model_class
    try:
        model = model_class.from_pretrained(model_path, dtype=dtype)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SystemExit(f"--model_path: cannot load {model_path!r}: {first_line}") from None
    from peft_pretraining.model.layernorm_scaling import reapply_layernorm_scaling_from_config

    # A checkpoint saved with LNS hooks unfolded (finetune.py's intermediate checkpoints) says so in its config;
    # without the hooks every tool would measure the model without LNS.
    if reapply_layernorm_scaling_from_config(model):
        print(f"[model_io] {model_path} was saved with LayerNorm Scaling hooks; re-applied them", file=sys.stderr)
    return model.to(device).eval()


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """The tokenizer saved with the model; for a local folder without one, the repository's tokenizer.

    Our training runs may save only the model, so a local checkpoint without tokenizer files falls back to
    data/tokenizer (with a printed notice) rather than failing.
    """
    from transformers import AutoTokenizer

    candidates = [tokenizer_path] if tokenizer_path else [model_path]
    if not tokenizer_path and Path(model_path).is_dir() and REPO_TOKENIZER.is_dir():
        candidates.append(str(REPO_TOKENIZER))
    errors = []
    for candidate in candidates:
        try:
            # Our model type is registered (above), and no code of a folder is run.
            tokenizer = AutoTokenizer.from_pretrained(candidate, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as err:
            errors.append(f"{candidate}: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}")
            continue
        if candidate != candidates[0]:
            print(f"[model_io] no tokenizer in {model_path}; using {candidate}", file=sys.stderr)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        return tokenizer
    flag = "--tokenizer" if tokenizer_path else "--model_path"
    raise SystemExit(f"{flag}: cannot load a tokenizer ({'; '.join(errors)})")


def _is_repo_tokenizer(tokenizer) -> bool:
    return Path(tokenizer.name_or_path).resolve() == REPO_TOKENIZER.resolve()


def load_model_and_tokenizer(model_path: str, dtype: torch.dtype | str = torch.float32,
                             device: str | torch.device = "cpu", tokenizer_path: str | None = None):
    tokenizer = load_tokenizer(model_path, tokenizer_path)
    model = load_model(model_path, dtype=dtype, device=device)
    vocab_size = model.get_input_embeddings().num_embeddings
    if tokenizer_path is None and _is_repo_tokenizer(tokenizer) and vocab_size > vocab_size_covering(tokenizer):
        # The fallback cannot be the model's tokenizer: it would feed wrong ids, and every analysis would still run.
        raise SystemExit(f"--tokenizer: {model_path!r} has no tokenizer and embeds {vocab_size} tokens, more than "
                         f"the repository's {len(tokenizer)}-token tokenizer; pass the tokenizer it was trained with")
    if len(tokenizer) > vocab_size:
        raise SystemExit(f"--tokenizer: the tokenizer has {len(tokenizer)} tokens but {model_path!r} "
                         f"embeds only {vocab_size}; pass the tokenizer the model was trained with")
    return model, tokenizer


# ----------------------------------------------------------------------------- context length
def resolve_context_length(model_or_config, requested: int | None, log=print, fallback: int | None = None) -> int:
    """Tokens per window for evaluating a model (or its config, or a config.json dict).

    ``requested`` (--max_seq_len) when given, else the length the model was trained at (config
    ``train_max_length``, written by torchrun_main.py), else the tool's own ``fallback`` for hub models, which record
    no trained length (the angular and variance tools keep their 256-token windows, or max_position_embeddings
    when that is smaller), else
    ``max_position_embeddings`` (what lm-eval uses by default). Prints one line saying which length is used and
    why, plus a warning when ``requested`` goes past the trained length (positions the model never saw in training)."""
    config = getattr(model_or_config, "config", model_or_config)
    if isinstance(config, dict):  # a config.json read as is (read_local_config)
        config = SimpleNamespace(**config)
    trained = getattr(config, "train_max_length", None)
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"--max_seq_len: must be a positive integer, got {requested!r}")
        log(f"[context] {requested} tokens per window (--max_seq_len)")
        if trained is not None and requested > trained:
            log(f"[context] warning: --max_seq_len {requested} exceeds the trained context {trained}; "
                f"positions past {trained} were never seen in training")
        return requested
    if trained is not None:
        log(f"[context] {trained} tokens per window: the model was trained at that length (config "
            "train_max_length; --max_seq_len overrides)")
        return int(trained)
    positions = getattr(config, "max_position_embeddings", None)
    if fallback is not None and positions is not None and positions < fallback:
        log(f"[context] {positions} tokens per window: the model records no trained length, and its "
            f"max_position_embeddings is below this tool's default {fallback} (--max_seq_len overrides)")
        return int(positions)
    if fallback is not None:
        log(f"[context] {fallback} tokens per window: the model records no trained length, so this tool's default "
            "(--max_seq_len overrides)")
        return int(fallback)
    fallback = positions
    if fallback is None:
        raise ValueError("--max_seq_len: the model's config records neither train_max_length nor "
                         "max_position_embeddings; pass --max_seq_len")
    log(f"[context] {fallback} tokens per window: the model records no trained length, so its "
        "max_position_embeddings (--max_seq_len overrides)")
    return int(fallback)


# ----------------------------------------------------------------------------- residual stream
class ResidualStream:
    """Callable returning the residual stream of one batch at every depth.

    ``stream(input_ids, attention_mask)`` returns ``num_layers + 1`` float32 tensors of shape
    ``[num_real_tokens, hidden]``: index 0 is the input of decoder layer 0 (the embeddings), index ``l`` the
    output of decoder layer ``l - 1``. Pad positions are dropped. The final norm and the LM head are skipped
    (only the backbone runs), which saves the vocabulary projection. Only one batch is held at a time.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.backbone = backbone(model)
        self.layers = decoder_layers(model)
        # HF backbones would build a KV cache by default; ours has no use_cache argument.
        takes_use_cache = "use_cache" in inspect.signature(self.backbone.forward).parameters
        self.backbone_kwargs = {"use_cache": False} if takes_use_cache else {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        keep = attention_mask.to(dtype=torch.bool)
        states: list[torch.Tensor] = []

        def record(hidden: torch.Tensor) -> None:
            states.append(hidden[keep].float())

        # Ours whose stream is not one running sum (AttnRes, mHC, SiameseNorm) say what a layer's output is: the
        # same view that their output_hidden_states returns (docs/analyses.md).
        stream_view = getattr(self.backbone, "residual_stream", None)

        def before_first_layer(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            record(stream_view.layer_output(hidden) if stream_view is not None else hidden)

        def after_layer(_module, _args, output):
            if stream_view is not None:
                record(stream_view.layer_output(output))
            else:
                record(output[0] if isinstance(output, (tuple, list)) else output)

        handles = [self.layers[0].register_forward_pre_hook(before_first_layer, with_kwargs=True)]
        handles += [layer.register_forward_hook(after_layer) for layer in self.layers]
        try:
            self.backbone(input_ids=input_ids, attention_mask=attention_mask, **self.backbone_kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if len(states) != self.num_layers + 1:
            raise RuntimeError(f"expected {self.num_layers + 1} residual-stream captures, got {len(states)}; "
                               "does the model skip or repeat decoder layers?")
        return states


# ----------------------------------------------------------------------------- text
def read_documents(path: str | os.PathLike) -> Iterator[str]:
    """.jsonl / .json lines (optionally .gz): one document per line, its "text" field; any other file: the whole
    file is one document."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    is_jsonl = path.name.removesuffix(".gz").endswith((".jsonl", ".json"))
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            if not is_jsonl:
                yield handle.read()
                return
            for line_number, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"--text_file: {path} line {line_number} is not a JSON object with a "
                                         "\"text\" field") from None
    except (OSError, EOFError, zlib.error) as err:  # e.g. a .gz that is not gzip, or is cut short
        raise ValueError(f"--text_file: cannot read {path} ({err})") from None


def hub_is_reachable(timeout_s: float = 3.0) -> bool:
    """False when the offline environment flags are set or huggingface.co does not answer within timeout_s."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
    except Exception:  # any failure (DNS, refused, timeout, HTTP error) means "do not stream from the hub"
        return False
    return True


def resolve_text_source(dataset: str, text_file: str | None) -> tuple[str, Path | None]:
    """Decide where the text comes from. Returns ("c4", None) or ("file", path).

    Rule: --text_file wins. Otherwise --dataset c4 streams C4 en validation when the hub is reachable and falls
    back to the embedded held-out novel (with a notice) when it is not; --dataset embedded always uses the novel.
    """
    if dataset not in TEXT_SOURCES:
        raise ValueError(f"--dataset: {dataset!r} is not one of {', '.join(TEXT_SOURCES)}")
    if text_file:
        if not Path(text_file).is_file():
            raise ValueError(f"--text_file: {text_file!r} does not exist")
        return "file", Path(text_file)
    if dataset == "c4":
        if hub_is_reachable():
            return "c4", None
        print("[model_io] the hub is not reachable (offline); using the embedded held-out novel instead of C4",
              file=sys.stderr)
    if not EMBEDDED_HELDOUT_TEXT.is_file():
        raise ValueError(f"--dataset: the embedded held-out text {EMBEDDED_HELDOUT_TEXT} is missing; "
                         "pass --text_file")
    return "file", EMBEDDED_HELDOUT_TEXT


def iter_documents(source: tuple[str, Path | None]) -> Iterator[str]:
    """C4 documents one by one (streamed), or the documents of a local file (see read_documents)."""
    kind, path = source
    if kind == "c4":
        from datasets import load_dataset

        for row in load_dataset("allenai/c4", "en", split="validation", streaming=True):
            yield row["text"]
    else:
        yield from read_documents(path)


def special_prefix_ids(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before a text (e.g. [BOS] for Llama, [] for Qwen)."""
    with_special = tokenizer("x")["input_ids"]
    without = tokenizer("x", add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(without) + 1):
        if with_special[start:start + len(without)] == without:
            return list(with_special[:start])
    return []


def token_windows(tokenizer, documents: Iterable[str], max_seq_len: int, num_tokens: int) -> Iterator[list[int]]:
    """Split each document into consecutive windows of at most max_seq_len tokens (each opened with the
    tokenizer's own prefix, e.g. BOS) and stop after exactly num_tokens tokens in total."""
    prefix = special_prefix_ids(tokenizer)
    body = max_seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"--max_seq_len: {max_seq_len} leaves no room after the {len(prefix)} special tokens")
    remaining = num_tokens
    for document in documents:
        ids = tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"]
        for start in range(0, len(ids), body):
            window = (prefix + ids[start:start + body])[:remaining]
            remaining -= len(window)
            yield window
            if remaining <= 0:
                return


def padded_batches(windows: Iterable[list[int]], batch_size: int, pad_id: int,
                   sort_buffer: int = 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask) batches of up to batch_size windows.

    Windows are read batch_size * sort_buffer at a time and batched by length, so short documents share a batch
    and little compute goes to padding. The order does not matter to the analyses, which average over tokens.
    """
    def collate(group):
        width = max(len(window) for window in group)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, window in enumerate(group):
            input_ids[row, :len(window)] = torch.tensor(window, dtype=torch.long)
            attention_mask[row, :len(window)] = 1
        return input_ids, attention_mask

    def flush(buffer):
        buffer.sort(key=len, reverse=True)
        for start in range(0, len(buffer), batch_size):
            yield collate(buffer[start:start + batch_size])

    buffer: list[list[int]] = []
    for window in windows:
        buffer.append(window)
        if len(buffer) == batch_size * sort_buffer:
            yield from flush(buffer)
            buffer = []
    if buffer:
        yield from flush(buffer)


def token_batches(tokenizer, source, max_seq_len: int, num_tokens: int, batch_size: int):
    windows = token_windows(tokenizer, iter_documents(source), max_seq_len, num_tokens)
    return padded_batches(windows, batch_size, tokenizer.pad_token_id)


# ----------------------------------------------------------------------------- command line
def add_model_arguments(parser, default_model: str | None = "Qwen/Qwen3-8B") -> None:
    parser.add_argument("--model_path", default=default_model, required=default_model is None,
                        help="hub id or local folder (our checkpoints are recognised by config.json's norm_type)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path or hub id (default: the model's own; for a local folder without "
                             "one, data/tokenizer)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="weights dtype; auto = bfloat16 on GPU, float32 on CPU (analysis maths is float32)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")


def add_threads_argument(parser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 is fastest on a busy shared CPU)")


def apply_threads(parser, args) -> None:
    if args.threads is not None:
        check_positive(parser, args, "threads")
        torch.set_num_threads(args.threads)


def add_text_arguments(parser, default_num_tokens: int, cpu_num_tokens: int | None = None) -> None:
    """--dataset, --text_file, --num_tokens, --max_seq_len, --batch_size. With ``cpu_num_tokens``, --num_tokens
    defaults to ``default_num_tokens`` on a GPU and to ``cpu_num_tokens`` on a CPU (resolve_num_tokens)."""
    parser.add_argument("--dataset", default="c4", choices=TEXT_SOURCES,
                        help="c4: C4 en validation streamed from the hub, falling back to the embedded held-out "
                             "novel when the hub is unreachable; embedded: the held-out novel")
    parser.add_argument("--text_file", default=None,
                        help="local text file: plain text (one document), or .jsonl/.json lines with a \"text\" "
                             "field; optionally .gz; overrides --dataset")
    if cpu_num_tokens is None:
        parser.add_argument("--num_tokens", type=int, default=default_num_tokens,
                            help="number of real (non-pad) tokens to analyse")
    else:
        parser.add_argument("--num_tokens", type=int, default=None,
                            help=f"number of real (non-pad) tokens to analyse (default: {default_num_tokens:,} on a "
                                 f"GPU, {cpu_num_tokens:,} on a CPU)")
        parser.set_defaults(num_tokens_defaults=(default_num_tokens, cpu_num_tokens))
    add_context_argument(parser)
    parser.add_argument("--batch_size", type=int, default=8, help="windows per forward pass")


def resolve_num_tokens(args, device: torch.device, tool: str) -> int:
    """--num_tokens as given, else the device's default from add_text_arguments, said on stderr before any work
    (a CPU default is smaller than a GPU's: the GPU count, the paper's for the angular tool, would take a CPU minutes
    to an hour)."""
    if args.num_tokens is None:
        gpu_default, cpu_default = args.num_tokens_defaults
        args.num_tokens = cpu_default if device.type == "cpu" else gpu_default
        if device.type == "cpu":
            print(f"[{tool}] on a CPU: {cpu_default:,} tokens by default ({gpu_default:,} on a GPU); "
                  "--num_tokens N sets it", file=sys.stderr)
    return args.num_tokens


def add_context_argument(parser) -> None:
    """--max_seq_len, shared by every evaluation tool; None resolves through resolve_context_length."""
    parser.add_argument("--max_seq_len", type=int, default=None,
                        help="tokens per window (default: the length the model was trained at, from its config's "
                             "train_max_length; for hub models without one, 256 for the residual-stream tools (or "
                             "max_position_embeddings if smaller) and max_position_embeddings for lm-eval)")


def check_positive_or_none(parser, args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name}: must be a positive integer, got {value}")


def check_positive(parser, args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is None or value < 1:
            parser.error(f"--{name}: must be a positive integer, got {value}")

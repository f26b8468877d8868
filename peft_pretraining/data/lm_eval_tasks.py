"""lm-eval tasks built from the repository's own data, so that evaluation runs offline.

Each builder writes, under an output folder, the task's documents as JSON lines and a task YAML (lm-eval 0.4.x
format) that points at them by absolute path; ``task_manager(include_paths)`` then makes the task available to
``lm_eval.simple_evaluate`` by name, and the same folder works with the CLI: ``lm_eval --include_path DIR``.

    python -m peft_pretraining.lm_eval_tasks --output_dir /tmp/lm_eval_tasks      # writes heldout_novel_ppl

Builders are registered in LOCAL_TASK_BUILDERS (name -> function(output_dir, **options) -> task folder); add a
new task by writing its builder next to the existing ones and registering it there.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Callable, Iterable

import yaml

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data.dataloader import EMBEDDED_DIR

HELDOUT_PERPLEXITY_TASK = "heldout_novel_ppl"
EMBEDDED_HELDOUT = EMBEDDED_DIR / "validation.jsonl.gz"


def read_texts(path: str | Path) -> list[str]:
    """Documents of a .jsonl[.gz] file (its "text" fields) or paragraphs (blank-line separated) of a text file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task text file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        if path.name.removesuffix(".gz").endswith((".jsonl", ".json")):
            return [json.loads(line)["text"] for line in handle if line.strip()]
        return [block.strip() for block in handle.read().split("\n\n") if block.strip()]


def write_task(output_dir: str | Path, task_name: str, documents: Iterable[dict], task_config: dict) -> Path:
    """Write output_dir/task_name/{task_name}.jsonl and {task_name}.yaml; returns the task folder.

    ``task_config`` holds the YAML fields other than the task name and the data location.
    """
    task_dir = Path(output_dir).resolve() / task_name
    task_dir.mkdir(parents=True, exist_ok=True)
    data_file = task_dir / f"{task_name}.jsonl"
    with data_file.open("w", encoding="utf-8") as handle:
        count = 0
        for document in documents:
            handle.write(json.dumps(document, ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        raise ValueError(f"task {task_name}: no documents to write")
    split = task_config.get("test_split", "test")
    config = {"task": task_name, "dataset_path": "json",
              "dataset_kwargs": {"data_files": {split: str(data_file)}}, **task_config}
    (task_dir / f"{task_name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return task_dir


def build_heldout_perplexity_task(output_dir: str | Path, text_file: str | Path | None = None,
                                  max_documents: int | None = None, task_name: str = HELDOUT_PERPLEXITY_TASK) -> Path:
    """Perplexity of held-out text through ``loglikelihood_rolling`` (like lm-eval's wikitext task).

    Default text: the embedded held-out novel (never seen in training). Reports word_perplexity,
    byte_perplexity and bits_per_byte; lower is better. lm-eval scores each document in rolling windows of
    HFLM's ``max_length`` tokens (``max_position_embeddings`` unless given), so callers pass the length the model
    was trained at (``utils.instruments.model_io.resolve_context_length``; ``max_length=`` in the CLI's --model_args).
    """
    texts = read_texts(text_file or EMBEDDED_HELDOUT)
    if max_documents is not None:
        texts = texts[:max_documents]
    task_config = {
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "doc_to_text": "",
        "doc_to_target": "text",  # a column name: the document is scored verbatim, no template rendering
        # lm-eval's own aggregations for these metrics, stated so that it does not warn about each one at every load
        "metric_list": [{"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                        {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                        {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}],
        "metadata": {"version": 1.0, "source": str(text_file or EMBEDDED_HELDOUT)},
    }
    return write_task(output_dir, task_name, ({"text": text} for text in texts), task_config)


# ----------------------------------------------------------------------------- next-sentence multiple choice
NEXT_SENTENCE_TASK = "embedded_next_sentence"
# A sentence ends at . ! or ? (plus closing quotes/brackets) followed by a capitalised word or the end of the text.
SENTENCE_PATTERN = r"\S.*?[.!?][\"')\]]*(?=\s+[\"'(\[]?[A-Z]|\s*$)"


def split_sentences(text: str, min_words: int = 4) -> list[str]:
    """Sentences of at least ``min_words`` words (shorter fragments make trivially easy or ambiguous choices)."""
    import re

    return [sentence for sentence in re.findall(SENTENCE_PATTERN, " ".join(text.split()))
            if len(sentence.split()) >= min_words]


def next_sentence_items(texts: list[str], num_examples: int, num_choices: int = 4, context_sentences: int = 3,
                        seed: int = 0, fits: Callable[[str], bool] | None = None) -> list[dict]:
    """"Which sentence continues this passage?" items: up to ``context_sentences`` consecutive sentences of a text,
    the sentence that follows them, and ``num_choices - 1`` distractor sentences from other texts, shuffled.
    Only sentences for which ``fits`` is true (default: all) become choices. Deterministic for a given seed."""
    import collections
    import random

    if num_choices < 2:
        raise ValueError(f"num_choices must be at least 2, got {num_choices}")
    rng = random.Random(seed)
    sentences_by_text = [split_sentences(text) for text in texts]
    # Sentences that do not fit are skipped where they come up, so the draws, and the items, stay those of the
    # unfiltered task whenever no sentence had to be skipped.
    choices_by_text = [[s for s in sentences if fits is None or fits(s)] for sentences in sentences_by_text]
    fitting = {s for sentences in choices_by_text for s in sentences}
    positions = [(t, i) for t, sentences in enumerate(sentences_by_text) for i in range(1, len(sentences))]
    if not positions or sum(1 for sentences in choices_by_text if sentences) < num_choices:
        raise ValueError(f"too few multi-sentence passages to build {num_choices}-way next-sentence items")
    rng.shuffle(positions)
    # Distinct sentences outside text t = all distinct sentences but those found in no other text.
    texts_holding = collections.Counter(s for sentences in choices_by_text for s in set(sentences))
    outside_count = [len(texts_holding) - sum(1 for s in set(sentences) if texts_holding[s] == 1)
                     for sentences in choices_by_text]
    items = []
    for text_index, position in positions:
        if len(items) == num_examples:
            break
        sentences = sentences_by_text[text_index]
        answer = sentences[position]
        if answer not in fitting:
            continue
        answer_elsewhere = texts_holding[answer] > 1  # then the pool below excludes it
        if outside_count[text_index] - answer_elsewhere < num_choices - 1:  # the draw below would never end
            raise ValueError(f"too few distinct sentences outside text {text_index} for {num_choices}-way items")
        distractors = set()
        while len(distractors) < num_choices - 1:
            other = rng.randrange(len(sentences_by_text))
            if other != text_index and choices_by_text[other]:
                candidate = rng.choice(sentences_by_text[other])
                if candidate != answer and candidate in fitting:
                    distractors.add(candidate)
        choices = [answer] + sorted(distractors)
        rng.shuffle(choices)
        items.append({"context": " ".join(sentences[max(0, position - context_sentences):position]),
                      "choices": choices, "label": choices.index(answer)})
    return items


def build_next_sentence_task(output_dir: str | Path, text_file: str | Path | None = None, num_examples: int = 500,
                             num_choices: int = 4, seed: int = 0, task_name: str = NEXT_SENTENCE_TASK,
                             tokenizer=None, max_choice_tokens: int | None = None) -> Path:
    """Multiple choice: pick the sentence that continues a passage of the held-out novel (chance 1/num_choices).

    Scored by the log-likelihood of each choice after the context; reports acc and acc_norm (higher is better).
    With ``tokenizer`` and ``max_choice_tokens`` (the evaluation window less one), only sentences that fit become
    choices: lm-eval refuses a continuation longer than its window, and the held-out novel has sentences of over
    200 tokens.
    """
    fits = None
    if max_choice_tokens is not None:
        if tokenizer is None:
            raise ValueError("max_choice_tokens needs the tokenizer that will score the choices")
        def fits(sentence: str) -> bool:  # lm-eval scores " " + choice after the context
            return len(tokenizer.encode(" " + sentence, add_special_tokens=False)) <= max_choice_tokens
    items = next_sentence_items(read_texts(text_file or EMBEDDED_HELDOUT), num_examples, num_choices, seed=seed,
                                fits=fits)
    task_config = {
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "context",  # column names: no template rendering
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "source": str(text_file or EMBEDDED_HELDOUT), "seed": seed},
    }
    return write_task(output_dir, task_name, items, task_config)


LOCAL_TASK_BUILDERS: dict[str, Callable[..., Path]] = {
    HELDOUT_PERPLEXITY_TASK: build_heldout_perplexity_task,
    NEXT_SENTENCE_TASK: build_next_sentence_task,
}


def build_local_tasks(task_names: Iterable[str], output_dir: str | Path,
                      options_by_task: dict[str, dict] | None = None) -> list[Path]:
    """Build every requested task that is one of ours (with its builder options); returns their folders for
    include_path. Names that are not local tasks (mmlu, ...) are left to lm-eval's own registry."""
    options_by_task = options_by_task or {}
    return [LOCAL_TASK_BUILDERS[name](output_dir, **options_by_task.get(name, {}))
            for name in task_names if name in LOCAL_TASK_BUILDERS]


def task_manager(include_paths: Iterable[str | Path] = (), include_defaults: bool = True):
    from lm_eval.tasks import TaskManager

    paths = [str(path) for path in include_paths]
    return TaskManager(include_path=paths or None, include_defaults=include_defaults)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="folder to pass to lm_eval --include_path")
    parser.add_argument("--tasks", default=HELDOUT_PERPLEXITY_TASK,
                        help=f"comma-separated local tasks; available: {', '.join(LOCAL_TASK_BUILDERS)}")
    parser.add_argument("--text_file", default=None, help="text for the perplexity task (default: embedded held-out)")
    parser.add_argument("--max_documents", type=int, default=None, help="keep only the first N documents")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOCAL_TASK_BUILDERS]
    if unknown:
        parser.error(f"--tasks: unknown local task(s) {', '.join(unknown)}; available: "
                     f"{', '.join(LOCAL_TASK_BUILDERS)}")
    if args.max_documents is not None and args.max_documents < 1:
        parser.error(f"--max_documents: must be positive, got {args.max_documents}")
    try:
        heldout_options = {"text_file": args.text_file, "max_documents": args.max_documents}
        folders = build_local_tasks(names, args.output_dir, {HELDOUT_PERPLEXITY_TASK: heldout_options})
    except ValueError as err:
        parser.error(str(err))
    for folder in folders:
        print(f"wrote {folder}")
    print(f"use with: lm_eval --include_path {Path(args.output_dir).resolve()} --tasks {','.join(names)} "
          "--model hf --model_args pretrained=MODEL,max_length=TRAINED_LENGTH ...")


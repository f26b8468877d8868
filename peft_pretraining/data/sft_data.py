"""Instruction data for supervised fine-tuning (Commonsense170K / LLM-Adapters format).

Each record has ``instruction``, optional ``input``, ``output`` (the response the model learns) and optional
``answer`` (the short label, unused in training). Prompts follow the Alpaca-style template LLM-Adapters
trains Commonsense170K with, so checkpoints fine-tuned here are comparable with that literature.
"""
from __future__ import annotations

import os

import torch

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
REQUIRED_FIELDS = ("instruction", "output")
IGNORE_INDEX = -100


def format_prompt(example: dict) -> str:
    """The prompt part (everything the model is conditioned on, nothing it is trained to produce)."""
    extra = (example.get("input") or "").strip()
    template = PROMPT_WITH_INPUT if extra else PROMPT_NO_INPUT
    return template.format(instruction=example["instruction"].strip(), input=extra)


def is_local_data(source: str) -> bool:
    return source.endswith((".json", ".jsonl")) or os.path.exists(source)


def load_instruction_dataset(source: str, split: str = "train", max_samples: int | None = None):
    """A local .json/.jsonl file, or a hub dataset name (e.g. zwhe99/commonsense_170k) when online."""
    from datasets import load_dataset

    if is_local_data(source):
        if not os.path.isfile(source):
            raise ValueError(f"--dataset {source!r}: no such file")
        with open(source, "rb") as f:
            if not f.read(4096).strip():
                raise ValueError(f"--dataset {source!r}: the file holds no records")
        dataset = load_dataset("json", data_files={split: os.path.abspath(source)}, split=split)
    else:
        dataset = load_dataset(source, split=split)
    missing = [field for field in REQUIRED_FIELDS if field not in dataset.column_names]
    if missing:
        raise ValueError(
            f"--dataset {source!r} lacks field(s) {', '.join(missing)} (has {', '.join(dataset.column_names)}); "
            "expected the LLM-Adapters format: instruction, input, output, answer"
        )
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def tokenize_example(example: dict, tokenizer, max_length: int) -> dict:
    """input_ids = [bos] prompt response [eos]; labels copy the response (and eos), -100 elsewhere.

    Prompt and response are tokenized separately so the boundary is exact whatever the tokenizer merges.
    Truncation keeps the start; an example whose response is cut away entirely gets no labels.
    """
    prompt_ids = tokenizer(format_prompt(example), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(example["output"].strip(), add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    if tokenizer.eos_token_id is not None:
        response_ids = response_ids + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "labels": labels, "num_response_tokens": sum(t != IGNORE_INDEX for t in labels)}


def tokenize_dataset(dataset, tokenizer, max_length: int):
    """Tokenizes every record and drops those left with no response token after truncation."""
    tokenized = dataset.map(
        lambda example: tokenize_example(example, tokenizer, max_length),
        remove_columns=dataset.column_names,
        desc="tokenizing",
    )
    return tokenized.filter(lambda example: example["num_response_tokens"] > 0, desc="dropping empty responses")


class SFTCollator:
    """Right-pads a list of tokenized examples into input_ids / attention_mask / labels tensors."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict]) -> dict:
        length = max(len(example["input_ids"]) for example in examples)
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for example in examples:
            padding = length - len(example["input_ids"])
            batch["input_ids"].append(list(example["input_ids"]) + [self.pad_token_id] * padding)
            batch["attention_mask"].append([1] * len(example["input_ids"]) + [0] * padding)
            batch["labels"].append(list(example["labels"]) + [IGNORE_INDEX] * padding)
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}


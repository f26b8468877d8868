"""Tiny models, blocks with known effects, and texts shared by the analysis tests (angular, variance, removal)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from peft_pretraining.data.dataloader import EMBEDDED_DIR, TOKENIZER_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO_ROOT / "configs" / "llama_tiny.json"
VOCAB_SIZE = 8192


def repo_tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def tiny_hf_llama(num_layers: int = 3, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def tiny_ours(norm_type: str, num_layers: int = 4, seed: int = 0, **overrides):
    from peft_pretraining.model.modeling_llama import LlamaForCausalLM as OurLlama
    from peft_pretraining.model.modeling_llama import build_config

    torch.manual_seed(seed)
    config = build_config(TINY_CONFIG, norm_type=norm_type, num_hidden_layers=num_layers, **overrides)
    return OurLlama(config).eval()


class ScaleBlock(nn.Module):
    """A stand-in decoder layer that multiplies the residual stream by a constant (1: identity, -1: negation)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states * self.factor


def with_blocks(model, factors: list[float]):
    """Replace the model's decoder layers by ScaleBlocks with the given factors."""
    model.model.layers = nn.ModuleList(ScaleBlock(factor) for factor in factors)
    model.config.num_hidden_layers = len(factors)
    return model


def heldout_documents(count: int) -> list[str]:
    import gzip

    with gzip.open(EMBEDDED_DIR / "validation.jsonl.gz", "rt", encoding="utf-8") as handle:
        return [json.loads(next(handle))["text"] for _ in range(count)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def save_with_tokenizer(model, path: Path) -> Path:
    model.save_pretrained(path)
    repo_tokenizer().save_pretrained(path)
    return path


def run_cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a repository script the way a user would, offline."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(REPO_ROOT), TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_records(folder: Path) -> dict[str, dict]:
    """{run name: record} of a report folder's runs/ (utils/study/records.py's format)."""
    from utils.study import records

    return {records.name_of(path): records.read(path) for path in records.paths_in(Path(folder) / "runs")}


def write_records(folder: Path, runs: dict[str, dict]) -> Path:
    """A report folder whose runs/ holds these records, written as the study writes them."""
    from utils.study import records

    for name, record in runs.items():
        records.write(Path(folder) / "runs", name, record)
    return Path(folder)

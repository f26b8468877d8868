"""Offline stand-ins for the paper's hub inputs, made from the embedded Austen corpus.

    python utils/offline_fixtures.py c4 OUT_DIR     # C4's layout: OUT_DIR/en/c4-{train,validation}.*.json.gz
    python utils/offline_fixtures.py t5 OUT_DIR     # a T5-style sentencepiece tokenizer: pad 0, EOS 1, unk 2

The trainer then reads them through the same calls as `allenai/c4` and `t5-base`:

    python torchrun_main.py ... --dataset OUT_DIR/c4 --dataset_config en --tokenizer OUT_DIR/t5

C4: the hub repository `allenai/c4` declares its configs in the YAML header of its README.md (config `en`: train files
`en/c4-train.*.json.gz`, validation files `en/c4-validation.*.json.gz`, JSON lines with the string fields text,
timestamp and url). The folder written here has the same README header, file names and fields, so
`datasets.load_dataset(folder, "en", split=..., streaming=True)` resolves it the way it resolves the hub dataset.

t5-base: a SentencePiece unigram model with <pad>=0, </s>=1, <unk>=2 and no BOS, plus 100 <extra_id_*> sentinels, in
a folder laid out like the hub repository (spiece.model, tokenizer.json, config.json with model_type t5), so
`AutoTokenizer.from_pretrained(folder)` builds the same `T5Tokenizer` class. The vocabulary is small (2,000 pieces
instead of 32,000): the corpus is small, and ids only need to fit the model's embedding.
"""
import argparse
import gzip
import io
import json
import pathlib

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data.dataloader import embedded_split_path, write_jsonl_gz

C4_CONFIG = "en"
C4_README = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/c4-train.*.json.gz
  - split: validation
    path: en/c4-validation.*.json.gz
dataset_info:
- config_name: en
  features:
  - name: text
    dtype: string
  - name: timestamp
    dtype: string
  - name: url
    dtype: string
---
# C4 layout, Austen content

An offline stand-in for `allenai/c4` (config `en`) written by `utils/offline_fixtures.py`.
"""
T5_VOCAB_SIZE = 2_000
T5_EXTRA_IDS = 100


def _embedded_records(split: str) -> list[dict]:
    with gzip.open(embedded_split_path(split), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _c4_record(record: dict, index: int) -> dict:
    """C4's fields; timestamp and url are made up but deterministic."""
    seconds = index * 7919 % 86_400
    clock = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return {"text": record["text"], "timestamp": f"2019-04-{1 + index % 28:02d}T{clock}Z",
            "url": f"https://austen.example/{record.get('source', 'austen')}/{index}"}


def write_c4_layout(out_dir, train_shards: int = 4, validation_shards: int = 2) -> pathlib.Path:
    """OUT_DIR/README.md and OUT_DIR/en/c4-<split>.<i>-of-<n>.json.gz, documents dealt round-robin to the shards."""
    out_dir = pathlib.Path(out_dir)
    for split, shards in (("train", train_shards), ("validation", validation_shards)):
        records = [_c4_record(r, i) for i, r in enumerate(_embedded_records(split))]
        for shard in range(shards):
            write_jsonl_gz(out_dir / C4_CONFIG / f"c4-{split}.{shard:05d}-of-{shards:05d}.json.gz",
                            records[shard::shards])
    (out_dir / "README.md").write_text(C4_README)
    return out_dir


def write_t5_style_tokenizer(out_dir, vocab_size: int = T5_VOCAB_SIZE) -> pathlib.Path:
    """Train the sentencepiece model on the embedded train split; write spiece.model, tokenizer.json, config.json."""
    import sentencepiece
    from transformers import AutoTokenizer

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = [r["text"] for r in _embedded_records("train")]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        character_coverage=1.0, minloglevel=2)
    (out_dir / "spiece.model").write_bytes(model.getvalue())
    (out_dir / "config.json").write_text(json.dumps({"model_type": "t5"}) + "\n")
    # Converted from spiece.model by transformers, as the hub's tokenizer.json was.
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), extra_ids=T5_EXTRA_IDS)
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("c4", "t5"))
    parser.add_argument("out_dir")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if pathlib.Path(args.out_dir).exists() and not pathlib.Path(args.out_dir).is_dir():
        parser.error(f"out_dir {args.out_dir}: exists and is not a folder")
    path = write_c4_layout(args.out_dir) if args.what == "c4" else write_t5_style_tokenizer(args.out_dir)
    print(path)


if __name__ == "__main__":
    main()

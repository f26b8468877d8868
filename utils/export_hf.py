"""Export a checkpoint of ours to a stock `transformers.LlamaForCausalLM` directory.

Works for pre, lns, layerscale, skipinit and completep (LNS factors, gates and L^-alpha are folded into the weights);
the other placements have no stock form and load with trust_remote_code=True instead.

    python utils/export_hf.py --checkpoint runs/tiny_lns-<time>/model_150 --out exported/tiny-lns

The result loads with `AutoModelForCausalLM.from_pretrained(OUT)`, no trust_remote_code needed.
"""

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.layernorm_scaling import (
    fold_layernorm_scaling,
    reapply_layernorm_scaling_from_config,
)
from peft_pretraining.model.llama_export import export_to_hf_llama
from peft_pretraining.model.modeling_llama import LlamaForCausalLM


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="an HF directory saved by this repository")
    parser.add_argument("--out", required=True, help="where to write the stock-HF directory")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {checkpoint}: no config.json there")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out}: directory exists and is not empty; refusing to overwrite")

    try:
        model = LlamaForCausalLM.from_pretrained(checkpoint)
    except (OSError, ValueError) as error:  # e.g. a config without weights beside it
        parser.error(f"--checkpoint {checkpoint}: cannot load it ({str(error).strip().splitlines()[0]})")
    # A checkpoint saved with LNS hooks unfolded (finetune.py's checkpoint-N/) says so in its config: fold them in.
    if reapply_layernorm_scaling_from_config(model):
        fold_layernorm_scaling(model)
    try:
        hf_model = export_to_hf_llama(model)
    except ValueError as error:
        parser.error(f"--checkpoint {checkpoint}: {error}")
    hf_model.save_pretrained(out)
    if (checkpoint / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)  # our model type is registered
        tokenizer.save_pretrained(out)
    print(f"exported {checkpoint} -> {out} (stock transformers LlamaForCausalLM)")


if __name__ == "__main__":
    main()

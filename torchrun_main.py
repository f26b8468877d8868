"""Pretrain a LLaMA-style model with a chosen norm placement.

    parse -> seed -> tokenizer + model -> wrap (DDP | FSDP2) -> train loop (eval, checkpoints) -> results.json

Single process:  python torchrun_main.py --model_config configs/llama_tiny.json --dataset embedded --batch_size 8 ...
Several:         torchrun --nproc_per_node 4 torchrun_main.py ...   (nccl on GPU, gloo on CPU)

Exit codes: 0 finished, 2 bad command line or checkpoint, 3 diverged (NaN/inf loss or grad norm; see results.json).
torchrun reports any failed rank as 1; run_*.sh read each rank's own code back (utils/launch_trainer.sh).
"""
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from peft_pretraining import args_utils, training_utils
from peft_pretraining.dataloader import (
    build_train_stream,
    check_vocab_covers_tokenizer,
    iter_eval_batches,
    load_tokenizer,
)
from peft_pretraining.distributed import grad_sync, init_distributed, report_exit_code, wrap_model
from peft_pretraining.modeling_llama import LlamaForCausalLM, build_config

VOCAB_MULTIPLE = 64


class BadInput(Exception):
    """A user error found after parsing (tokenizer, dataset, checkpoint): one line, exit code 2."""


# ----------------------------------------------------------------------------------------------------------------
# Set-up
# ----------------------------------------------------------------------------------------------------------------

def resolve_run_dir(args, rank: int) -> str:
    """--save_dir, or runs/<run_name>-<UTC time> chosen by rank 0 and shared so every rank agrees."""
    run_dir = [args.save_dir]
    if run_dir[0] is None:
        run_dir[0] = os.path.join("runs", f"{args.run_name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        dist.broadcast_object_list(run_dir, src=0)
    if rank == 0:
        os.makedirs(run_dir[0], exist_ok=True)
    dist.barrier()
    return run_dir[0]


def build_model_config(args, tokenizer, log):
    config = build_config(args.model_config, norm_type=args.norm_type, post_num=args.post_num,
                          init_method=args.init_method)
    if len(tokenizer) > config.vocab_size:
        # e.g. t5-base has 32100 ids for the paper's 32000-row configs; round up so the matmul shapes stay friendly.
        resized = math.ceil(len(tokenizer) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        log(f"vocab: resized vocab_size {config.vocab_size} -> {resized} to cover the tokenizer's {len(tokenizer)} "
            f"ids (rounded up to a multiple of {VOCAB_MULTIPLE})")
        config.vocab_size = resized
    check_vocab_covers_tokenizer(config.vocab_size, tokenizer)
    # The checkpoint should describe the tokenizer it was trained with.
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    return config


def check_checkpoint_matches(args, config, checkpoint: str):
    with open(os.path.join(checkpoint, "config.json")) as f:
        saved = json.load(f)
    for flag in ("norm_type", "post_num", "init_method"):
        if flag in saved and saved[flag] != getattr(config, flag):
            raise BadInput(f"--{flag} {getattr(config, flag)!r} differs from the checkpoint's {saved[flag]!r} "
                           f"(--continue_from {checkpoint})")
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size"):
        if saved.get(key) != getattr(config, key):
            raise BadInput(f"--model_config {args.model_config}: {key}={getattr(config, key)} differs from the "
                           f"checkpoint's {saved.get(key)} (--continue_from {checkpoint})")


@contextlib.contextmanager
def user_errors():
    """The data pipeline raises ValueError naming the flag (--tokenizer, --dataset, ...): report it as bad input."""
    try:
        yield
    except ValueError as err:
        raise BadInput(str(err)) from err


def autocast_for(args, device):
    if args.dtype == "mixed":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    try:
        args = args_utils.parse_args(argv)
    except SystemExit as exit:  # a bad command line (2) or --help (0)
        return report_exit_code(exit.code)
    rank, world_size, device = init_distributed(args)
    try:
        code = train(args, rank, world_size, device)
        dist.barrier()  # torchrun stops every rank once one exits non-zero: leave after rank 0 wrote results.json
    except (BadInput, training_utils.CheckpointError) as err:
        if rank == 0:
            print(f"torchrun_main.py: error: {' '.join(str(err).split())}", file=sys.stderr)  # one line
        code = 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return report_exit_code(code)


def train(args, rank: int, world_size: int, device) -> int:
    is_main = rank == 0

    def log(message: str):
        if is_main:
            tqdm.write(message)

    training_utils.seed_everything(args.seed)
    with user_errors():
        tokenizer = load_tokenizer(args.tokenizer)
    config = build_model_config(args, tokenizer, log)

    # ---- model --------------------------------------------------------------------------------------------
    resume_state = None
    model = LlamaForCausalLM(config)
    if args.continue_from is not None:
        check_checkpoint_matches(args, config, args.continue_from)
        resume_state = training_utils.load_training_state(args.continue_from)
        if resume_state["world_size"] != world_size:
            raise BadInput(f"--continue_from {args.continue_from}: saved with world size {resume_state['world_size']}, "
                           f"this run has {world_size} (the data position is per rank)")
        if resume_state["update_step"] >= args.num_training_steps:
            raise BadInput(f"--num_training_steps {args.num_training_steps}: the checkpoint is already at step "
                           f"{resume_state['update_step']}")
        weights = training_utils.load_model_weights(args.continue_from)
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as err:
            raise training_utils.CheckpointError(
                f"--continue_from {args.continue_from}: weights do not fit the model ({str(err).splitlines()[0]})")
    if args.dtype == "bfloat16":
        model = model.to(dtype=torch.bfloat16)  # pure bf16 weights and optimizer state, as in the paper
    model = model.to(device)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {args.model_config} norm_type={config.norm_type} post_num={config.post_num} "
        f"init={config.init_method} params={n_params / 1e6:.2f}M dtype={args.dtype} device={device} "
        f"world_size={world_size} wrap={'fsdp2' if args.fsdp else 'ddp' if world_size > 1 else 'none'}")

    # ---- data: open both splits now, so a wrong name or a missing split fails before any training ----------
    data_source = dict(dataset=args.dataset, dataset_path=args.dataset_path, dataset_config=args.dataset_config,
                       tokenizer=tokenizer, max_length=args.max_length, packing=args.packing)
    with user_errors():
        stream = build_train_stream(**data_source, batch_size=args.batch_size, seed=args.seed, rank=rank,
                                    world_size=world_size, num_workers=args.workers)
        next(iter_eval_batches(**data_source, batch_size=1, eval_tokens=world_size, rank=rank,
                               world_size=world_size), None)
        if resume_state is not None:
            stream.load_state_dict(resume_state["data"][rank])

    run_dir = resolve_run_dir(args, rank)  # only now: bad input above leaves no empty run folder behind
    train_model = wrap_model(model, args, world_size, device)
    if args.compile:
        train_model = torch.compile(train_model)  # the uncompiled `model` shares its weights: saving is unchanged
    optimizer = training_utils.build_optimizer(train_model.parameters(), args.optimizer, args.lr, args.weight_decay)
    update_step, tokens_seen = 0, 0
    if resume_state is not None:
        training_utils.load_optimizer_state(train_model, optimizer, resume_state["optimizer"])
        update_step, tokens_seen = resume_state["update_step"], resume_state["tokens_seen"]
    # On resume the schedule continues at update_step with this command line's --lr/--warmup_steps/...
    # (pass the same flags for an exact resume; differences are printed below).
    scheduler = training_utils.build_scheduler(optimizer, scheduler_type=args.scheduler,
                                               num_training_steps=args.num_training_steps,
                                               warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio,
                                               lr=args.lr, weight_decay=args.weight_decay, resume_at=update_step)
    if resume_state is not None:
        training_utils.restore_rng_state(resume_state["rng"][rank])  # last, after everything that draws numbers
        log(f"resumed from {args.continue_from}: update step {update_step}, tokens seen {tokens_seen}")
        for flag, (saved, now) in training_utils.changed_flags(resume_state.get("args", {}), vars(args)).items():
            log(f"note: --{flag} is {now!r} now, {saved!r} in the checkpoint's run (using {now!r})")
        del resume_state

    # ---- logging --------------------------------------------------------------------------------------------
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics = training_utils.MetricsFile(
        metrics_path, resume_step=update_step if args.continue_from else None) if is_main else None
    run_config = dict(vars(args), world_size=world_size, n_params=n_params, vocab_size=config.vocab_size,
                      run_dir=run_dir)
    wandb_run = None
    if is_main:
        tags = [t.strip() for t in args.tags.split(",") if t.strip()] if args.tags else None
        wandb_run = training_utils.init_wandb(project=args.wandb_project, run_name=args.run_name, config=run_config,
                                              tags=tags, run_dir=run_dir)

    autocast = autocast_for(args, device)

    def run_eval() -> dict:
        batches = iter_eval_batches(**data_source, batch_size=args.eval_batch_size, eval_tokens=args.eval_tokens,
                                    rank=rank, world_size=world_size)
        return training_utils.evaluate(train_model if args.fsdp else model, batches, device=device,
                                       eval_tokens=args.eval_tokens, autocast=autocast, lockstep=args.fsdp,
                                       show_progress=is_main)

    def save(step: int) -> str:
        model_state, optimizer_state = training_utils.full_state_dicts(train_model, optimizer)
        rng_states = training_utils.gather_rank_objects(training_utils.capture_rng_state())
        data_states = training_utils.gather_rank_objects(stream.state_dict())
        # DDP replicas must be bit-identical; record every rank's checksum so a silent desync is visible.
        checksums = (training_utils.gather_rank_objects(training_utils.parameter_checksum(model))
                     if not args.fsdp else None)
        path = training_utils.checkpoint_dir(run_dir, step)
        if is_main:
            if checksums is not None and len(set(checksums)) > 1:
                log(f"WARNING: ranks' parameters differ at step {step}: checksums {checksums}")
            path = training_utils.save_checkpoint(
                run_dir, step, hf_model=model, model_state=model_state, tokenizer=tokenizer,
                training_state={"update_step": step, "tokens_seen": tokens_seen, "world_size": world_size,
                                "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                                "rng": rng_states, "data": data_states, "args": vars(args),
                                "rank_param_checksums": checksums})
            log(f"checkpoint: {path}")
        dist.barrier()
        return path

    # ---- training loop ----------------------------------------------------------------------------------------
    log(f"training {args.num_training_steps - update_step} updates of {args.total_batch_size} sequences x "
        f"{args.max_length} tokens (batch {args.batch_size} x accumulation {args.gradient_accumulation} x "
        f"world {world_size}); run folder {run_dir}")
    bar = tqdm(total=args.num_training_steps, initial=update_step, desc="update steps", ncols=100,
               disable=not is_main)
    status, last_eval, last_checkpoint, diverged_reason = "finished", None, None, None
    train_model.train()
    while update_step < args.num_training_steps:
        update_start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        tokens_in_update = torch.zeros((), dtype=torch.int64, device=device)
        for micro in range(args.gradient_accumulation):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(stream).items()}
            tokens_in_update += batch["attention_mask"].sum()
            with grad_sync(train_model, micro == args.gradient_accumulation - 1):
                with autocast():
                    loss = train_model(**batch).loss
                (loss / args.gradient_accumulation).backward()
            loss_sum += loss.detach().float()
        # One small all-reduce per update: mean loss over micro-batches and ranks, and the tokens of all ranks.
        update_stats = torch.stack([loss_sum.double() / args.gradient_accumulation / world_size,
                                    tokens_in_update.double()])
        dist.all_reduce(update_stats)
        step_loss, step_tokens = update_stats[0].item(), int(update_stats[1].item())
        grad_norm = training_utils.grad_norm_and_clip(train_model.parameters(), args.grad_clipping)
        lr = optimizer.param_groups[0]["lr"]

        if not math.isfinite(step_loss) or not math.isfinite(grad_norm):
            diverged_reason = f"non-finite {'loss' if not math.isfinite(step_loss) else 'grad norm'}"
        elif args.divergence_loss is not None and step_loss > args.divergence_loss:
            diverged_reason = f"loss {step_loss:.4f} above --divergence_loss {args.divergence_loss}"
        if diverged_reason is not None:
            status = "diverged"
            optimizer.zero_grad(set_to_none=True)  # the bad update is never applied
            if is_main:
                metrics.write({"step": update_step + 1, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                               "tokens_seen": tokens_seen, "diverged": diverged_reason})
            log(f"diverged at update step {update_step + 1}: {diverged_reason}; stopping (last checkpoint kept)")
            update_step += 1
            break

        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_step += 1
        tokens_seen += step_tokens
        row = {"step": update_step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm, "tokens_seen": tokens_seen,
               "tokens_per_s": step_tokens / (time.perf_counter() - update_start)}
        if update_step % args.eval_every == 0 or update_step == args.num_training_steps:
            last_eval = dict(run_eval(), step=update_step)
            row.update(eval_loss=last_eval["eval_loss"], eval_ppl=last_eval["eval_ppl"])
            log(f"step {update_step}: eval loss {last_eval['eval_loss']:.4f} ppl {last_eval['eval_ppl']:.2f} "
                f"over {last_eval['eval_tokens']} tokens")
        if is_main:
            metrics.write(row)
            if wandb_run is not None:
                wandb_run.log(row, step=update_step)
            bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}")
            bar.update(1)
        if update_step % args.save_every == 0 or update_step == args.num_training_steps:
            last_checkpoint = save(update_step)
    bar.close()
    stream.close()

    # ---- results ------------------------------------------------------------------------------------------------
    if not is_main:
        return training_utils.EXIT_DIVERGED if status == "diverged" else 0
    metrics.close()
    results = {
        "status": status,
        "step": update_step,
        "num_training_steps": args.num_training_steps,
        "final_eval_loss": last_eval["eval_loss"] if status == "finished" else None,
        "final_eval_ppl": last_eval["eval_ppl"] if status == "finished" else None,
        "eval_tokens": last_eval["eval_tokens"] if status == "finished" else None,
        "tokens_seen": tokens_seen,
        "diverged_reason": diverged_reason,
        "norm_type": config.norm_type,
        "post_num": config.post_num,
        "model_config": args.model_config,
        "checkpoint": last_checkpoint,
    }
    results_path = os.path.join(run_dir, "results.json")
    with open(results_path, "w") as f:
        json.dump({k: training_utils._json_safe(v) for k, v in results.items()}, f, indent=2)
    plot_path = os.path.join(run_dir, "loss_curve.png")
    training_utils.plot_loss_curve(metrics_path, plot_path, title=f"{args.run_name} ({status})")
    wandb_dir = wandb_run.dir if wandb_run is not None else None
    if wandb_run is not None:
        wandb_run.summary.update({k: v for k, v in results.items() if v is not None})
        wandb_run.finish(exit_code=training_utils.EXIT_DIVERGED if status == "diverged" else 0)
    print(f"\nstatus:     {status} at update step {update_step}"
          + (f" ({diverged_reason})" if diverged_reason else "")
          + (f"\neval:       loss {results['final_eval_loss']:.4f}, ppl {results['final_eval_ppl']:.2f} over "
             f"{results['eval_tokens']} tokens" if status == "finished" else "")
          + f"\nrun folder: {run_dir}\nmetrics:    {metrics_path}\nresults:    {results_path}\nplot:       {plot_path}"
          + f"\ncheckpoint: {last_checkpoint or 'none written by this run'}"
          + (f"\nwandb:      {wandb_dir} ({training_utils.wandb_mode()})" if wandb_dir else ""),
          flush=True)
    return training_utils.EXIT_DIVERGED if status == "diverged" else 0


if __name__ == "__main__":
    sys.exit(main())

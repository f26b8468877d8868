"""Pretrain a LLaMA-style model with a chosen norm placement.

    parse -> seed -> tokenizer + model -> wrap (DDP | FSDP2) -> train loop (eval, checkpoints) -> results.json

Single process:  python torchrun_main.py --model_config configs/llama_tiny.json --dataset embedded --batch_size 8 ...
Several:         torchrun --nproc_per_node 4 torchrun_main.py ...   (nccl on GPU, gloo on CPU)

Exit codes (docs/training.md#exit-codes): 0 finished, 1 error, 2 bad input, 3 diverged, 4 no space left,
5 stopped by SIGTERM/SIGUSR1 after saving, 6 out of memory.

The run folder (peft_pretraining/run_folder.py) is locked by rank 0 for the whole run, recovered at start-up after a
crash, and holds one history: resuming from step k moves the folder's later checkpoints into superseded/.
torchrun reports any failed rank as 1; run_*.sh read each rank's own code back (utils/launch_trainer.sh).
"""
import contextlib
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from peft_pretraining import args_utils, checkpointing, run_folder, training_utils
from peft_pretraining.dataloader import (
    IGNORE_INDEX,
    VOCAB_MULTIPLE,
    build_train_stream,
    check_vocab_covers_tokenizer,
    count_target_tokens,
    iter_eval_batches,
    load_tokenizer,
    vocab_size_covering,
)
from peft_pretraining.distributed import (broadcast_from_rank0, grad_sync, init_distributed, leave_process_group,
                                          report_exit_code, wrap_model)
from peft_pretraining.modeling_llama import LlamaForCausalLM, build_config, canonical_norm_type


class BadInput(Exception):
    """A user error found after parsing (tokenizer, dataset, checkpoint): one line, exit code 2."""


# ----------------------------------------------------------------------------------------------------------------
# Set-up
# ----------------------------------------------------------------------------------------------------------------

def open_run_folder(args, rank: int, resume_step: int | None, on_exit: contextlib.ExitStack, log) -> str:
    """--save_dir, or runs/<run_name>-<UTC time> chosen by rank 0 and shared so every rank agrees.

    Rank 0 creates it, locks it until the run ends (a second process gets a one-line error naming the holder's PID),
    cleans up after a crash, and, when resuming from step k, moves the folder's checkpoints past k into superseded/.
    Refused in one line, under the lock: a fresh start into a folder holding a run, a branch (--continue_from another
    folder's checkpoint) into a folder holding a run, and a folder that cannot be created.
    """
    run_dir = [args.save_dir]
    if run_dir[0] is None:
        run_dir[0] = os.path.join("runs", f"{args.run_name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        broadcast_from_rank0(run_dir)
    run_dir = run_dir[0]
    dist.barrier()  # every rank has read its checkpoint before rank 0 renames anything
    refusal = [None]
    if rank == 0:
        try:
            os.makedirs(run_dir, exist_ok=True)
            on_exit.enter_context(run_folder.locked(run_dir))
        except run_folder.RunFolderBusy as err:
            refusal[0] = str(err)
        except OSError as err:  # a parent that is a file, no permission, a read-only filesystem, a full disk
            refusal[0] = f"--save_dir {run_dir}: cannot create the run folder ({err.strerror or err})"
            if run_folder.is_no_space(err):
                refusal[0] = (refusal[0], run_folder.EXIT_NO_SPACE)
        else:
            # Decided under the lock: a run that ended while this one was starting is not taken over.
            if resume_step is None and args_utils.holds_a_run(run_dir):
                refusal[0] = f"--save_dir {run_dir} already holds a run; pass --continue_from {run_dir} to resume it"
            elif resume_step is not None and args_utils.branches_into_another_run(args.continue_from, run_dir):
                refusal[0] = args_utils.branch_refusal(args.continue_from, run_dir)
            else:
                notes = run_folder.recover(run_dir)
                if resume_step is not None:
                    notes += run_folder.supersede_after(run_dir, resume_step)
                for note in notes:
                    log(note)
    broadcast_from_rank0(refusal)
    if isinstance(refusal[0], tuple):
        raise run_folder.SaveFailed(*refusal[0])
    if refusal[0] is not None:
        raise BadInput(refusal[0])
    if args.continue_from is not None and not os.path.exists(args.continue_from):  # a .model_N.old just restored
        args.continue_from = training_utils.checkpoint_dir(run_dir, resume_step)
    args.save_dir = run_dir  # from here on, errors name the folder in use
    return run_dir


def build_model_config(args, tokenizer, log):
    options = {option: getattr(args, option) for option in args_utils.MODEL_OPTIONS}
    try:
        config = build_config(args.model_config, **options)
    except ValueError as err:
        raise BadInput(f"--model_config {args.model_config}: {err}") from err
    if config.embed_init_std is None:  # record the value used, so that the checkpoint says what was trained
        config.embed_init_std = config.initializer_range
    if len(tokenizer) > config.vocab_size:
        # e.g. t5-base has 32100 ids for the paper's 32000-row configs; round up so the matmul shapes stay friendly.
        resized = vocab_size_covering(tokenizer)
        log(f"vocab: resized vocab_size {config.vocab_size} -> {resized} to cover the tokenizer's {len(tokenizer)} "
            f"ids (rounded up to a multiple of {VOCAB_MULTIPLE})")
        config.vocab_size = resized
    check_vocab_covers_tokenizer(config.vocab_size, tokenizer)
    # The checkpoint should describe the tokenizer it was trained with.
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    if args.max_length > config.max_position_embeddings:
        raise BadInput(f"--max_length {args.max_length}: longer than the model's max_position_embeddings "
                       f"{config.max_position_embeddings} ({args.model_config})")
    # Evaluation tools stay inside the context the model was trained at (utils/model_io.resolve_context_length).
    config.train_max_length = args.max_length
    return config


def check_checkpoint_matches(args, config, checkpoint: str):
    with open(os.path.join(checkpoint, "config.json")) as f:
        saved = json.load(f)
    if "norm_type" in saved:
        saved["norm_type"] = canonical_norm_type(saved["norm_type"])  # a "cod" checkpoint resumes as "lns"
    for flag in args_utils.MODEL_OPTIONS:
        if flag in saved and saved[flag] != getattr(config, flag):
            raise BadInput(f"--{flag} {getattr(config, flag)!r} differs from the checkpoint's {saved[flag]!r} "
                           f"(--continue_from {checkpoint})")
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size"):
        if saved.get(key) != getattr(config, key):
            raise BadInput(f"--model_config {args.model_config}: {key}={getattr(config, key)} differs from the "
                           f"checkpoint's {saved.get(key)} (--continue_from {checkpoint})")


def unfinished_last_checkpoint(args, resume_state: dict) -> bool:
    """The run's last checkpoint, resumed in its own folder, which has no results.json: the run stopped between its
    last save and its results, and resuming it only evaluates and writes them."""
    own_folder = args_utils.checkpoint_run_folder(args.continue_from)
    return (resume_state["update_step"] == args.num_training_steps and os.path.realpath(args.save_dir) == own_folder
            and not os.path.exists(os.path.join(own_folder, "results.json")))


def causal_mask_suffices(batch: dict) -> bool:
    """True when every row is real tokens then padding, and no pad is a label (checked on the CPU copy).

    A causal mask alone then gives the same loss and gradients as the padding mask: a real token only sees earlier
    tokens, all real, and what the pad positions compute reaches no loss term.
    """
    mask, labels = batch["attention_mask"], batch["labels"]
    right_padded = bool((mask[:, 1:] <= mask[:, :-1]).all())
    return right_padded and bool((labels[mask == 0] == IGNORE_INDEX).all())


@contextlib.contextmanager
def user_errors():
    """The data pipeline raises ValueError naming the flag (--tokenizer, --dataset, ...): report it as bad input."""
    try:
        yield
    except ValueError as err:
        raise BadInput(str(err)) from err


@contextlib.contextmanager
def failure_shared_by_every_rank(run_dir: str, no_space: str | None = None, failed: str = "rank 0 failed",
                                 on_failure=None):
    """Around work that rank 0 alone does (the other ranks run an empty body): rank 0's outcome is broadcast, so a
    failure ends every rank with the code rank 0 chose (2 bad input, 4 no space, else 1 with rank 0's traceback)
    instead of leaving the others in their next collective; on a multi-node run every node then reports it.
    `no_space` and `failed` word the one-line messages; `on_failure` cleans up on rank 0 before the outcome goes."""
    failure, error = [None], None
    try:
        yield
    except BadInput as err:
        failure[0] = (str(err), 2)
    except run_folder.SaveFailed as err:
        failure[0] = (str(err), err.exit_code)
    except Exception as err:
        error = err
        failure[0] = ((no_space or f"run folder {run_dir}: no space left on device ({err.__class__.__name__})",
                       run_folder.EXIT_NO_SPACE) if run_folder.is_no_space(err, run_dir)
                      else (f"{failed} ({err.__class__.__name__})", 1))
    if failure[0] is not None and on_failure is not None:
        on_failure()
    broadcast_from_rank0(failure)
    if failure[0] is None:
        return
    if error is not None and failure[0][1] == 1:
        raise error
    if failure[0][1] == 2:
        raise BadInput(failure[0][0])
    raise run_folder.SaveFailed(*failure[0])


class HeldFailure:
    """An exception from what rank 0 alone writes inside the loop (metrics rows, wandb), held instead of raised: rank 0
    goes on to the next point where the ranks meet anyway (the next update's all-reduce carries the flag, save() and
    the results raise it as their own failure), so every rank ends with rank 0's code and no collective is added."""

    def __init__(self):
        self.error = None

    @contextlib.contextmanager
    def held(self):
        try:
            yield
        except Exception as err:
            self.error = err

    def raise_held(self):
        if self.error is not None:
            raise self.error


class StopRequest:
    """SIGTERM or SIGUSR1, as a scheduler sends them before a time limit or a preemption: noted here, and acted on
    where the ranks next meet (the update's closing all-reduce), so every rank finishes the same update, the run
    saves, writes results.json with status "stopped" and exits 5. Handlers are restored when the run ends."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, on_exit: contextlib.ExitStack):
        self.signal_name = None
        for stop_signal in self.SIGNALS:
            previous = signal.signal(stop_signal, self._note)
            on_exit.callback(signal.signal, stop_signal, previous)

    def _note(self, signum, frame):
        self.signal_name = signal.Signals(signum).name


def out_of_memory_message(args, rank: int, world_size: int) -> str:
    """What to change, in one line: the same total batch in smaller micro-batches, or activation checkpointing."""
    smaller = args.batch_size // 2
    advice = (f"--batch_size {smaller} keeps --total_batch_size {args.total_batch_size} with accumulation "
              f"{args.gradient_accumulation * 2}" if smaller >= 1 and args.batch_size % 2 == 0 else "")
    if not args.activation_checkpointing:
        advice += (" or " if advice else "") + "--activation_checkpointing"
    last = args_utils.find_checkpoint(args.save_dir) if args.save_dir and os.path.isdir(args.save_dir) else None
    where = f"rank {rank}: " if world_size > 1 else ""
    return (f"{where}out of memory with --batch_size {args.batch_size} (--dtype {args.dtype}); "
            f"{'try ' + advice if advice else 'a smaller model or more devices'}; last good checkpoint: "
            f"{last or 'none'}")


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

    def error(message, exit_code: int) -> int:
        if rank == 0:
            print(f"torchrun_main.py: error: {' '.join(str(message).split())}", file=sys.stderr)  # one line
        return exit_code

    try:
        with contextlib.ExitStack() as on_exit:  # releases the run folder's lock however the run ends
            code = train(args, rank, world_size, device, on_exit)
        dist.barrier()  # torchrun stops every rank once one exits non-zero: leave after rank 0 wrote results.json
    except torch.OutOfMemoryError:
        # Printed by every rank that ran out (rank 0 may not be one of them). The other ranks of a multi-rank run
        # wait in a collective for this one, so it leaves at once and torchrun stops them.
        print(f"torchrun_main.py: error: {out_of_memory_message(args, rank, world_size)}", file=sys.stderr, flush=True)
        if world_size > 1:
            sys.stdout.flush()
            os._exit(report_exit_code(training_utils.EXIT_OUT_OF_MEMORY))
        code = training_utils.EXIT_OUT_OF_MEMORY
    except (BadInput, training_utils.CheckpointError) as err:
        code = error(err, 2)
    except run_folder.SaveFailed as err:  # raised on every rank, with the code rank 0 chose
        code = error(err, err.exit_code)
    except Exception as err:
        if not run_folder.is_no_space(err, args.save_dir):
            raise
        code = error(f"run folder {args.save_dir}: no space left on device ({err.__class__.__name__})",
                     run_folder.EXIT_NO_SPACE)
    finally:
        if dist.is_initialized():
            leave_process_group()
    return report_exit_code(code)


def train(args, rank: int, world_size: int, device, on_exit: contextlib.ExitStack) -> int:
    is_main = rank == 0

    def log(message: str):
        if is_main:
            tqdm.write(message)

    training_utils.seed_everything(args.seed)
    if device.type == "cpu" and training_utils.keep_freed_host_memory():
        log("host memory: freed tensors stay with the process for reuse, so steps do not page-fault anew "
            "(more resident memory; MALLOC_MMAP_THRESHOLD_=131072 in the environment opts out)")
    with user_errors():
        tokenizer = load_tokenizer(args.tokenizer)
    config = build_model_config(args, tokenizer, log)

    # ---- model --------------------------------------------------------------------------------------------
    resume_state = None
    if args.continue_from is not None:
        check_checkpoint_matches(args, config, args.continue_from)
        resume_state = training_utils.load_training_state(args.continue_from)
        if resume_state["world_size"] != world_size:
            raise BadInput(f"--continue_from {args.continue_from}: saved with world size {resume_state['world_size']}, "
                           f"this run has {world_size} (the data position is per rank)")
        if resume_state["update_step"] >= args.num_training_steps and not unfinished_last_checkpoint(args,
                                                                                                resume_state):
            if args.resume == "auto":  # a requeued job whose run has finished
                log(f"--resume auto: {args.save_dir} already finished at step {resume_state['update_step']}; "
                    f"nothing to do")
                return 0
            raise BadInput(f"--num_training_steps {args.num_training_steps}: the checkpoint is already at step "
                           f"{resume_state['update_step']}")
    sharded = resume_state is not None and resume_state.get("sharded")
    # FSDP2 resuming sharded state: no rank builds the full model; the weights are allocated shard by shard after
    # wrapping and filled from the checkpoint's sharded/ folder.
    meta_init = sharded and args.fsdp
    with torch.device("meta") if meta_init else contextlib.nullcontext():
        model = LlamaForCausalLM(config)
    if resume_state is not None and not sharded:
        training_utils.load_model_weights(args.continue_from, model)
    if args.dtype == "bfloat16":
        model = model.to(dtype=torch.bfloat16)  # pure bf16 weights and optimizer state, as in the paper
    if not meta_init:
        model = model.to(device)
    if args.activation_checkpointing:
        model.activation_checkpointing_enable()
    n_params = sum(p.numel() for p in model.parameters())
    options = " ".join(f"{option}={getattr(config, option)}" for option in args_utils.MODEL_OPTIONS[3:])
    log(f"model: {args.model_config} norm_type={config.norm_type} post_num={config.post_num} "
        f"init={config.init_method} {options} params={n_params / 1e6:.2f}M dtype={args.dtype} device={device} "
        f"world_size={world_size} wrap={'fsdp2' if args.fsdp else 'ddp' if world_size > 1 else 'none'}")
    frozen_gains_note = training_utils.pure_bf16_note(args.dtype, args.optimizer, args.lr)
    if frozen_gains_note:
        log(frozen_gains_note)

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

    # Only now: bad input above leaves no empty run folder behind.
    run_dir = open_run_folder(args, rank, resume_state["update_step"] if resume_state else None, on_exit, log)
    train_model = wrap_model(model, args, world_size, device)
    if meta_init:
        train_model.to_empty(device=device)  # this rank's shards only; load_sharded below fills them
        model.model.rotary_emb.reset_tables()  # a non-persistent buffer, in no checkpoint
    if args.compile:
        train_model = torch.compile(train_model)  # the uncompiled `model` shares its weights: saving is unchanged
    optimizer = training_utils.build_optimizer(train_model.parameters(), args.optimizer, args.lr, args.weight_decay,
                                               args.adam_kernel)
    update_step, tokens_seen = 0, 0
    if sharded:
        try:
            with training_utils.keeping_adam_kernel(optimizer):
                checkpointing.load_sharded(args.continue_from, train_model, optimizer)
        except checkpointing.ShardedLoadError as err:
            raise training_utils.CheckpointError(str(err)) from err
    elif resume_state is not None:
        training_utils.load_optimizer_state(train_model, optimizer, resume_state["optimizer"])
    if resume_state is not None:
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
    metrics = None
    run_config = dict(vars(args), world_size=world_size, n_params=n_params, vocab_size=config.vocab_size,
                      run_dir=run_dir)
    wandb_run = None
    with failure_shared_by_every_rank(run_dir):
        if is_main:  # rows past update_step (all of them for a run killed before its first checkpoint) are set aside
            with user_errors():
                metrics = training_utils.MetricsFile(metrics_path, resume_step=update_step)
            for note in metrics.notes:
                log(note)
            tags = [t.strip() for t in args.tags.split(",") if t.strip()] if args.tags else None
            with user_errors():  # a malformed RUN/wandb_run_id is bad input
                wandb_run = training_utils.init_wandb(project=args.wandb_project, run_name=args.run_name,
                                                      config=run_config, tags=tags, run_dir=run_dir,
                                                      resume=args.continue_from is not None)

    autocast = autocast_for(args, device)
    rank0_writes = HeldFailure()
    stop = StopRequest(on_exit)

    eval_batches: list[dict] = []  # this rank's share of the eval set, read once (each rank tokenizes all of it)

    def run_eval() -> dict:
        if not eval_batches:
            eval_batches.extend(iter_eval_batches(**data_source, batch_size=args.eval_batch_size,
                                                  eval_tokens=args.eval_tokens, rank=rank, world_size=world_size))
        return training_utils.evaluate(train_model if args.fsdp else model, eval_batches, device=device,
                                       eval_tokens=args.eval_tokens, autocast=autocast, lockstep=args.fsdp,
                                       show_progress=is_main)

    export_model = model
    if args.fsdp:  # fully_shard renamed the class FSDPLlamaForCausalLM: save_pretrained would record that (and copy
        with torch.device("meta"):  # torch's FSDP sources) as the model code; a weightless plain copy writes the export
            export_model = LlamaForCausalLM(config).to(next(model.parameters()).dtype)

    def save(step: int) -> str:
        """Every rank calls this; rank 0 writes, then tells every rank whether it worked (no rank is left waiting)."""
        sharded_dir = None
        if args.fsdp:  # each rank writes its own shards; rank 0 gathers the model weights for the HF export
            sharded_dir = checkpointing.save_sharded(run_dir, step, train_model, optimizer)
            model_state, optimizer_state = checkpointing.full_model_state(train_model), None
        else:
            model_state, optimizer_state = training_utils.full_state_dicts(train_model, optimizer)
        rng_states = training_utils.gather_rank_objects(training_utils.capture_rng_state())
        data_states = training_utils.gather_rank_objects(stream.state_dict())
        # DDP replicas must be bit-identical; record every rank's checksum so a silent desync is visible.
        checksums = (training_utils.gather_rank_objects(training_utils.parameter_checksum(model))
                     if not args.fsdp else None)
        path = training_utils.checkpoint_dir(run_dir, step)
        with failure_shared_by_every_rank(
                run_dir, no_space=f"run folder {run_dir}: no space left on device while saving {path}; removed the "
                                  f"partial checkpoint, the last good one is {last_checkpoint or 'none'}",
                failed=f"rank 0 could not save {path}",
                on_failure=lambda: run_folder.remove_partial_checkpoints(run_dir)):
            if is_main:
                if checksums is not None and len(set(checksums)) > 1:
                    log(f"WARNING: ranks' parameters differ at step {step}: checksums {checksums}")
                rank0_writes.raise_held()  # a row rank 0 failed to write: no checkpoint outlives it
                metrics.sync()  # a power loss may not keep a checkpoint without the rows up to it
                path = training_utils.save_checkpoint(
                    run_dir, step, hf_model=export_model, model_state=model_state, tokenizer=tokenizer,
                    training_state={"update_step": step, "tokens_seen": tokens_seen, "world_size": world_size,
                                    "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                                    "rng": rng_states, "data": data_states, "args": vars(args),
                                    "rank_param_checksums": checksums, "sharded": args.fsdp},
                    sharded_dir=sharded_dir)
                run_folder.fsync_dir(run_dir)  # the rename into model_<step> survives a power loss
                log(f"checkpoint: {path}")
                for removed in checkpointing.prune_checkpoints(run_dir, step, args.keep_last):
                    log(f"removed {removed} (--keep_last {args.keep_last})")
        return path

    # ---- training loop ----------------------------------------------------------------------------------------
    log(f"training {args.num_training_steps - update_step} updates of {args.total_batch_size} sequences x "
        f"{args.max_length} tokens (batch {args.batch_size} x accumulation {args.gradient_accumulation} x "
        f"world {world_size}); run folder {run_dir}")
    # Closed however the run ends, so that an error message gets a line of its own.
    bar = on_exit.enter_context(tqdm(total=args.num_training_steps, initial=update_step, desc="update steps",
                                     ncols=100, disable=not is_main))
    status, last_eval, diverged_reason = "finished", None, None
    last_checkpoint = args.continue_from  # the last good checkpoint of this history, None until one is saved
    first_compiled_step = update_step + 1
    train_model.train()
    while update_step < args.num_training_steps:
        update_start = time.perf_counter()
        with user_errors():  # bad data found mid-stream (an empty shard, a non-string text) is bad input too
            micro_batches = [next(stream) for _ in range(args.gradient_accumulation)]
        # Every target token of the update weighs the same, however padding splits them over micro-batches and
        # ranks: each micro-batch's mean loss is weighted by its share of the update's targets (all ranks). Every row
        # holds a target: the loader gives an empty document no row. The same all-reduce says whether rank 0 failed
        # to write the last update's row.
        targets = [count_target_tokens(batch["labels"]) for batch in micro_batches]
        update_totals = torch.tensor([sum(targets), rank0_writes.error is not None], dtype=torch.float64,
                                     device=device)
        dist.all_reduce(update_totals)
        update_targets, rank0_write_failed = update_totals.tolist()
        if rank0_write_failed:
            with failure_shared_by_every_rank(run_dir):
                rank0_writes.raise_held()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens_in_update = torch.zeros((), dtype=torch.int64, device=device)
        for micro, batch in enumerate(micro_batches):
            tokens_in_update += batch["attention_mask"].sum()
            if causal_mask_suffices(batch):
                del batch["attention_mask"]  # the model then takes SDPA's is_causal path
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            share = targets[micro] / update_targets
            with grad_sync(train_model, micro == args.gradient_accumulation - 1):
                with autocast():
                    loss = train_model(**batch).loss
                (loss * (share * world_size)).backward()  # DDP and FSDP average gradients over the ranks
            loss_sum += loss.detach().double() * share
        # One small all-reduce per update: the token-weighted mean loss, the tokens of all ranks, and whether any rank
        # was asked to stop (so that all stop after this same update).
        stop_noted = torch.tensor(float(stop.signal_name is not None), dtype=torch.float64, device=device)
        update_stats = torch.stack([loss_sum, tokens_in_update.double(), stop_noted])
        dist.all_reduce(update_stats)
        step_loss, step_tokens = update_stats[0].item(), int(update_stats[1].item())
        stopping = update_stats[2].item() > 0
        grad_norm = training_utils.grad_norm_and_clip(train_model.parameters(), args.grad_clipping)
        lr = optimizer.param_groups[0]["lr"]

        if not math.isfinite(step_loss) or not math.isfinite(grad_norm):
            diverged_reason = f"non-finite {'loss' if not math.isfinite(step_loss) else 'grad norm'}"
        elif args.divergence_loss is not None and step_loss > args.divergence_loss:
            diverged_reason = f"loss {step_loss:.4f} above --divergence_loss {args.divergence_loss}"
        if diverged_reason is not None:
            status = "diverged"
            optimizer.zero_grad(set_to_none=True)  # the bad update is never applied
            with rank0_writes.held():
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
        if args.compile and update_step == first_compiled_step:
            log(f"torch.compile: the first update took {time.perf_counter() - update_start:.1f} s, compilation "
                f"included")
        stopping = stopping and update_step < args.num_training_steps  # the last update finishes the run anyway
        saving = update_step % args.save_every == 0 or update_step == args.num_training_steps or stopping
        if saving and not training_utils.parameters_finite(model, device):
            status, diverged_reason = "diverged", f"non-finite weights after update step {update_step}"
            row["diverged"] = diverged_reason
            saving = False
        elif update_step % args.eval_every == 0 or update_step == args.num_training_steps:
            last_eval = dict(run_eval(), step=update_step)
            row.update(eval_loss=last_eval["eval_loss"], eval_ppl=last_eval["eval_ppl"],  # gains: every rank (FSDP)
                       norm_gain_mean=training_utils.mean_norm_gains(model),
                       final_norm_gain_mean=training_utils.final_norm_gain(model))
            log(f"step {update_step}: eval loss {last_eval['eval_loss']:.4f} ppl {last_eval['eval_ppl']:.2f} "
                f"over {last_eval['eval_tokens']} tokens")
        with rank0_writes.held():
            if is_main:
                metrics.write(row)
                if wandb_run is not None:
                    wandb_run.log(row, step=update_step)
                bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}")
                bar.update(1)
        if status == "diverged":
            log(f"diverged at update step {update_step}: {diverged_reason}; not saved (last checkpoint kept)")
            break
        if saving:
            last_checkpoint = save(update_step)
        if stopping:
            status = "stopped"
            log(f"{stop.signal_name or 'a stop signal (on another rank)'}: stopped after update step {update_step}; "
                f"the same command with --resume auto (or --continue_from {run_dir}) continues the run")
            break
    bar.close()
    stream.close()
    if last_eval is None and status == "finished":  # resumed at the last step: the results were never written
        last_eval = dict(run_eval(), step=update_step)

    # ---- results: written by rank 0; every rank leaves with its outcome -------------------------------------------
    exit_code = {"finished": 0, "diverged": training_utils.EXIT_DIVERGED,
                 "stopped": training_utils.EXIT_STOPPED}[status]
    with failure_shared_by_every_rank(run_dir):
        if is_main:
            rank0_writes.raise_held()  # a row of the last update that rank 0 failed to write
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
                "stop_signal": stop.signal_name if status == "stopped" else None,
                "norm_type": config.norm_type,
                "post_num": config.post_num,
                "model_config": args.model_config,
                "checkpoint": last_checkpoint,
            }
            results_path = os.path.join(run_dir, "results.json")
            run_folder.write_json_atomic(results_path, {k: training_utils._json_safe(v) for k, v in results.items()})
            plot_path = os.path.join(run_dir, "loss_curve.png")
            training_utils.plot_loss_curve(metrics_path, plot_path, title=f"{args.run_name} ({status})")
            gains_plot_path = training_utils.plot_norm_gains(metrics_path, os.path.join(run_dir, "norm_gains.png"),
                                                             title=f"{args.run_name}: mean RMSNorm gain per layer")
            wandb_dir = wandb_run.dir if wandb_run is not None else None
            if wandb_run is not None:
                wandb_run.summary.update({k: v for k, v in results.items() if v is not None})
                wandb_run.finish(exit_code=exit_code)
            print(f"\nstatus:     {status} at update step {update_step}"
                  + (f" ({diverged_reason})" if diverged_reason else "")
                  + (f"\neval:       loss {results['final_eval_loss']:.4f}, ppl {results['final_eval_ppl']:.2f} over "
                     f"{results['eval_tokens']} tokens" if status == "finished" else "")
                  + f"\nrun folder: {run_dir}\nmetrics:    {metrics_path}\nresults:    {results_path}"
                  + f"\nplot:       {plot_path}"
                  + (f"\nnorm gains: {gains_plot_path}" if gains_plot_path else "")
                  + f"\ncheckpoint: {last_checkpoint or 'none'}"
                  + (f"\nwandb:      {wandb_dir} ({training_utils.wandb_mode()})" if wandb_dir else ""),
                  flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())

"""Pretrain a LLaMA-style model with a chosen norm placement.

    parse -> seed -> tokenizer + model -> wrap (DDP | FSDP2) -> train loop (eval, checkpoints) -> results.json

Single process:  python torchrun_main.py --model_config configs/llama_tiny.json --dataset embedded --batch_size 8 ...
Several:         torchrun --nproc_per_node 4 torchrun_main.py ...   (nccl on GPU, gloo on CPU)

Exit codes: peft_pretraining/exit_codes.ExitCode (docs/training.md#exit-codes).

The run folder (peft_pretraining/training/run_folder.py) is locked by rank 0 for the whole run, recovered at start-up
after a crash, and holds one history: resuming from step k moves the folder's later checkpoints into superseded/.
torchrun reports any failed rank as 1; run_*.sh read each rank's own code back (utils/launch/launch_trainer.sh).
"""
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from peft_pretraining.data.dataloader import (
    IGNORE_INDEX,
    VOCAB_MULTIPLE,
    build_train_stream,
    check_vocab_covers_tokenizer,
    count_target_tokens,
    iter_eval_batches,
    load_tokenizer,
    vocab_size_covering,
)
from peft_pretraining.exit_codes import ExitCode
from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config, canonical_norm_type
from peft_pretraining.training import (
    args_utils,
    checkpointing,
    evaluation,
    host_memory,
    metrics_file,
    norm_gains,
    optimization,
    plots,
    rng,
    run_folder,
    wandb_logging,
)
from peft_pretraining.training.distributed import (
    broadcast_from_rank0,
    grad_sync,
    init_distributed,
    leave_process_group,
    report_exit_code,
    wrap_model,
)


class BadInput(Exception):
    """A user error found after parsing (tokenizer, dataset, checkpoint): one line, ExitCode.BAD_INPUT."""


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
                refusal[0] = (refusal[0], ExitCode.NO_SPACE)
        else:
            # Decided under the lock: a run that ended while this one was starting is not taken over.
            if resume_step is None and run_folder.holds_a_run(run_dir):
                refusal[0] = f"--save_dir {run_dir} already holds a run; pass --continue_from {run_dir} to resume it"
            elif resume_step is not None and run_folder.branches_into_another_run(args.continue_from, run_dir):
                refusal[0] = run_folder.branch_refusal(args.continue_from, run_dir)
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
        args.continue_from = checkpointing.checkpoint_dir(run_dir, resume_step)
    args.save_dir = run_dir  # from here on, errors name the folder in use
    return run_dir


def build_model_config(args, tokenizer, log):
    options = {option: getattr(args, option) for option in args_utils.model_options()}
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
    # Evaluation tools stay inside the context the model was trained at
    # (utils/instruments/model_io.resolve_context_length).
    config.train_max_length = args.max_length
    return config


def check_checkpoint_matches(args, config, checkpoint: str):
    with open(os.path.join(checkpoint, "config.json")) as f:
        saved = json.load(f)
    if "norm_type" in saved:
        saved["norm_type"] = canonical_norm_type(saved["norm_type"])  # a "cod" checkpoint resumes as "lns"
    for flag in args_utils.model_options():
        if flag in saved and saved[flag] != getattr(config, flag):
            raise BadInput(f"--{flag} {getattr(config, flag)!r} differs from the checkpoint's {saved[flag]!r} "
                           f"(--continue_from {checkpoint})")
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size"):
        if saved.get(key) != getattr(config, key):
            raise BadInput(f"--model_config {args.model_config}: {key}={getattr(config, key)} differs from the "
                           f"checkpoint's {saved.get(key)} (--continue_from {checkpoint})")


def unfinished_last_checkpoint(args, resume_step: int) -> bool:
    """The run's last checkpoint, resumed in its own folder, which has no results.json: the run stopped between its
    last save and its results, and resuming it only evaluates and writes them."""
    own_folder = run_folder.checkpoint_run_folder(args.continue_from)
    return (resume_step == args.num_training_steps and os.path.realpath(args.save_dir) == own_folder
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
    failure ends every rank with the code rank 0 chose (bad input, no space, else ERROR with rank 0's traceback)
    instead of leaving the others in their next collective; on a multi-node run every node then reports it.
    `no_space` and `failed` word the one-line messages; `on_failure` cleans up on rank 0 before the outcome goes."""
    failure, error = [None], None
    try:
        yield
    except BadInput as err:
        failure[0] = (str(err), ExitCode.BAD_INPUT)
    except run_folder.SaveFailed as err:
        failure[0] = (str(err), err.exit_code)
    except Exception as err:
        error = err
        failure[0] = ((no_space or f"run folder {run_dir}: no space left on device ({err.__class__.__name__})",
                       ExitCode.NO_SPACE) if run_folder.is_no_space(err, run_dir)
                      else (f"{failed} ({err.__class__.__name__})", ExitCode.ERROR))
    if failure[0] is not None and on_failure is not None:
        on_failure()
    broadcast_from_rank0(failure)
    if failure[0] is None:
        return
    if error is not None and failure[0][1] == ExitCode.ERROR:
        raise error
    if failure[0][1] == ExitCode.BAD_INPUT:
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
    saves, writes results.json with status "stopped" and exits ExitCode.STOPPED. Handlers are restored when the run
    ends."""

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
    last = run_folder.find_checkpoint(args.save_dir) if args.save_dir and os.path.isdir(args.save_dir) else None
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

    def error(message, exit_code: ExitCode) -> ExitCode:
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
            os._exit(report_exit_code(ExitCode.OUT_OF_MEMORY))
        code = ExitCode.OUT_OF_MEMORY
    except (BadInput, checkpointing.CheckpointError) as err:
        code = error(err, ExitCode.BAD_INPUT)
    except run_folder.SaveFailed as err:  # raised on every rank, with the code rank 0 chose
        code = error(err, err.exit_code)
    except Exception as err:
        if not run_folder.is_no_space(err, args.save_dir):
            raise
        code = error(f"run folder {args.save_dir}: no space left on device ({err.__class__.__name__})",
                     ExitCode.NO_SPACE)
    finally:
        if dist.is_initialized():
            leave_process_group()
    return report_exit_code(code)


# ----------------------------------------------------------------------------------------------------------------
# The run: everything the loop needs, built in order; then one update, an evaluation, a save, the results
# ----------------------------------------------------------------------------------------------------------------

class AlreadyFinished(Exception):
    """--resume auto on a run folder whose run has finished: a requeued job has nothing to do."""


@dataclasses.dataclass
class Progress:
    """Where the run stands: what a checkpoint records and results.json reports."""
    update_step: int = 0
    tokens_seen: int = 0
    last_checkpoint: str | None = None  # the last good checkpoint of this history
    status: str = "finished"  # or "diverged", "stopped"
    diverged_reason: str | None = None
    last_eval: dict | None = None


@dataclasses.dataclass
class Update:
    """One update's numbers, the same on every rank (after the update's all-reduce)."""
    loss: float
    tokens: int
    grad_norm: float
    stop_requested: bool  # some rank got SIGTERM or SIGUSR1


class Run:
    """Everything the loop needs. Every attribute is assigned here, in the order it is built; the helpers below
    return what they build."""

    def __init__(self, args, rank: int, world_size: int, device, on_exit: contextlib.ExitStack):
        self.args, self.rank, self.world_size, self.device = args, rank, world_size, device
        self.is_main = rank == 0
        rng.seed_everything(args.seed)
        if device.type == "cpu" and host_memory.keep_freed_host_memory():
            self.log("host memory: freed tensors stay with the process for reuse, so steps do not page-fault anew "
                     "(more resident memory; MALLOC_MMAP_THRESHOLD_=131072 in the environment opts out)")
        with user_errors():
            self.tokenizer = load_tokenizer(args.tokenizer)
        self.config = build_model_config(args, self.tokenizer, self.log)
        if args.continue_from is not None:
            check_checkpoint_matches(args, self.config, args.continue_from)
        self.checkpointer = checkpointing.Checkpointer(
            args.continue_from, rank=rank, world_size=world_size, fsdp=args.fsdp, keep_last=args.keep_last,
            resumable_last=args.resumable_last, log=self.log)
        self.refuse_a_finished_run()
        # FSDP2 resuming sharded state: no rank builds the full model; the weights are allocated shard by shard
        # after wrapping and filled from the checkpoint's sharded/ folder.
        meta_init = self.checkpointer.sharded and args.fsdp
        self.model = self.build_model(meta_init)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.describe_model()
        self.data_source = dict(dataset=args.dataset, dataset_path=args.dataset_path,
                                dataset_config=args.dataset_config, tokenizer=self.tokenizer,
                                max_length=args.max_length, packing=args.packing)
        self.stream = self.open_data()
        # Only now: bad input above leaves no empty run folder behind.
        self.run_dir = open_run_folder(args, rank, self.checkpointer.resume_step, on_exit, self.log)
        self.train_model = self.wrap_model(meta_init)
        self.optimizer = optimization.build_optimizer(self.train_model.parameters(), args.optimizer, args.lr,
                                                      args.weight_decay, args.adam_kernel)
        self.checkpointer.load_optimizer(self.train_model, self.optimizer)
        update_step, tokens_seen = self.checkpointer.resume_position()
        self.progress = Progress(update_step=update_step, tokens_seen=tokens_seen,
                                 last_checkpoint=args.continue_from)
        # On resume the schedule continues at update_step with this command line's --lr/--warmup_steps/...
        # (pass the same flags for an exact resume; differences are noted by load_rng).
        self.scheduler = optimization.build_scheduler(
            self.optimizer, scheduler_type=args.scheduler, num_training_steps=args.num_training_steps,
            warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio, lr=args.lr,
            weight_decay=args.weight_decay, resume_at=update_step)
        self.checkpointer.load_rng(args)
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self.metrics, self.wandb_run = self.open_logs()
        self.autocast = autocast_for(args, device)
        self.rank0_writes = HeldFailure()
        self.stop = StopRequest(on_exit)
        self.eval_batches: list[dict] = []  # this rank's share of the eval set, read at the first evaluation
        self.export_model = self.model
        if args.fsdp:  # fully_shard renamed the class FSDPLlamaForCausalLM: save_pretrained would record that (and
            # copy torch's FSDP sources) as the model code; a weightless plain copy writes the export
            with torch.device("meta"):
                self.export_model = LlamaForCausalLM(self.config).to(next(self.model.parameters()).dtype)

    def log(self, message: str):
        if self.is_main:
            tqdm.write(message)

    # ---- set-up, in the order __init__ calls it ---------------------------------------------------------------
    def refuse_a_finished_run(self):
        args, resume_step = self.args, self.checkpointer.resume_step
        if (resume_step is None or resume_step < args.num_training_steps
                or unfinished_last_checkpoint(args, resume_step)):
            return
        if args.resume == "auto":  # a requeued job whose run has finished
            self.log(f"--resume auto: {args.save_dir} already finished at step {resume_step}; nothing to do")
            raise AlreadyFinished
        raise BadInput(f"--num_training_steps {args.num_training_steps}: the checkpoint is already at step "
                       f"{resume_step}")

    def build_model(self, meta_init: bool):
        args = self.args
        with torch.device("meta") if meta_init else contextlib.nullcontext():
            model = LlamaForCausalLM(self.config)
        self.checkpointer.load_weights(model)
        if args.dtype == "bfloat16":
            model = model.to(dtype=torch.bfloat16)  # pure bf16 weights and optimizer state, as in the paper
        if not meta_init:
            model = model.to(self.device)
        if args.activation_checkpointing:
            model.activation_checkpointing_enable()
        return model

    def describe_model(self):
        args, config = self.args, self.config
        options = " ".join(f"{option}={getattr(config, option)}" for option in args_utils.model_options())
        wrap = "fsdp2" if args.fsdp else "ddp" if self.world_size > 1 else "none"
        self.log(f"model: {args.model_config} {options} params={self.n_params / 1e6:.2f}M dtype={args.dtype} "
                 f"device={self.device} world_size={self.world_size} wrap={wrap}")
        frozen_gains_note = optimization.pure_bf16_note(args.dtype, args.optimizer, args.lr)
        if frozen_gains_note:
            self.log(frozen_gains_note)

    def open_data(self):
        """The training stream, at the checkpoint's position; the eval split is opened too, so that a wrong name or a
        missing split fails before any training."""
        args = self.args
        with user_errors():
            stream = build_train_stream(**self.data_source, batch_size=args.batch_size, seed=args.seed,
                                        rank=self.rank, world_size=self.world_size, num_workers=args.workers)
            next(iter_eval_batches(**self.data_source, batch_size=1, eval_tokens=self.world_size, rank=self.rank,
                                   world_size=self.world_size), None)
            self.checkpointer.load_data_position(stream)
        return stream

    def wrap_model(self, meta_init: bool):
        """DDP or FSDP2 (wrap_model), then torch.compile when asked; `model` shares its weights."""
        train_model = wrap_model(self.model, self.args, self.world_size, self.device)
        if meta_init:
            train_model.to_empty(device=self.device)  # this rank's shards only; load_optimizer fills them
            self.model.model.rotary_emb.reset_tables()  # a non-persistent buffer, in no checkpoint
        if self.args.compile:
            train_model = torch.compile(train_model)  # saving goes through `model`: unchanged
        return train_model

    def open_logs(self):
        """(metrics file, wandb run), both on rank 0 only (None elsewhere); rows past the resumed step (all of them
        for a run killed before its first checkpoint) are set aside."""
        args = self.args
        metrics, wandb_run = None, None
        run_config = dict(vars(args), world_size=self.world_size, n_params=self.n_params,
                          vocab_size=self.config.vocab_size, run_dir=self.run_dir)
        with failure_shared_by_every_rank(self.run_dir):
            if self.is_main:
                with user_errors():
                    metrics = metrics_file.MetricsFile(self.metrics_path, resume_step=self.progress.update_step)
                for note in metrics.notes:
                    self.log(note)
                tags = [t.strip() for t in args.tags.split(",") if t.strip()] if args.tags else None
                with user_errors():  # a malformed RUN/wandb_run_id is bad input
                    wandb_run = wandb_logging.init_wandb(project=args.wandb_project, run_name=args.run_name,
                                                         config=run_config, tags=tags, run_dir=self.run_dir,
                                                         resume=args.continue_from is not None)
        return metrics, wandb_run

    # ---- one update -------------------------------------------------------------------------------------------
    def train_step(self) -> Update:
        """Forward and backward over the update's micro-batches; the optimizer is not stepped here."""
        args, device, world_size = self.args, self.device, self.world_size
        with user_errors():  # bad data found mid-stream (an empty shard, a non-string text) is bad input too
            micro_batches = [next(self.stream) for _ in range(args.gradient_accumulation)]
        # Every target token of the update weighs the same, however padding splits them over micro-batches and
        # ranks: each micro-batch's mean loss is weighted by its share of the update's targets (all ranks). Every
        # row holds a target: the loader gives an empty document no row. The same all-reduce says whether rank 0
        # failed to write the last update's row.
        targets = [count_target_tokens(batch["labels"]) for batch in micro_batches]
        update_totals = torch.tensor([sum(targets), self.rank0_writes.error is not None], dtype=torch.float64,
                                     device=device)
        dist.all_reduce(update_totals)
        update_targets, rank0_write_failed = update_totals.tolist()
        if rank0_write_failed:
            with failure_shared_by_every_rank(self.run_dir):
                self.rank0_writes.raise_held()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens_in_update = torch.zeros((), dtype=torch.int64, device=device)
        for micro, batch in enumerate(micro_batches):
            tokens_in_update += batch["attention_mask"].sum()
            if causal_mask_suffices(batch):
                del batch["attention_mask"]  # the model then takes SDPA's is_causal path
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            share = targets[micro] / update_targets
            with grad_sync(self.train_model, micro == args.gradient_accumulation - 1):
                with self.autocast():
                    loss = self.train_model(**batch, head_loss=args.loss).loss
                (loss * (share * world_size)).backward()  # DDP and FSDP average gradients over the ranks
            loss_sum += loss.detach().double() * share
        # One small all-reduce per update: the token-weighted mean loss, the tokens of all ranks, and whether any
        # rank was asked to stop (so that all stop after this same update).
        stop_noted = torch.tensor(float(self.stop.signal_name is not None), dtype=torch.float64, device=device)
        update_stats = torch.stack([loss_sum, tokens_in_update.double(), stop_noted])
        dist.all_reduce(update_stats)
        loss, tokens, stops = update_stats.tolist()  # one copy to the host, not one per value
        return Update(loss=loss, tokens=int(tokens),
                      grad_norm=optimization.grad_norm_and_clip(self.train_model.parameters(), args.grad_clipping),
                      stop_requested=stops > 0)

    def divergence(self, update: Update) -> str | None:
        if not math.isfinite(update.loss) or not math.isfinite(update.grad_norm):
            return f"non-finite {'loss' if not math.isfinite(update.loss) else 'grad norm'}"
        if self.args.divergence_loss is not None and update.loss > self.args.divergence_loss:
            return f"loss {update.loss:.4f} above --divergence_loss {self.args.divergence_loss}"
        return None

    def apply(self, update: Update):
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.update_step += 1
        self.progress.tokens_seen += update.tokens

    def write_row(self, row: dict):
        """Rank 0's metrics row (and wandb); an error is held until the ranks next meet (HeldFailure)."""
        with self.rank0_writes.held():
            if self.is_main:
                self.metrics.write(row)
                if self.wandb_run is not None:
                    self.wandb_run.log(row, step=row["step"])

    def stop_as_diverged(self, reason: str, what_is_kept: str):
        self.progress.status, self.progress.diverged_reason = "diverged", reason
        self.log(f"diverged at update step {self.progress.update_step}: {reason}; {what_is_kept}")

    # ---- evaluation and checkpoints -----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        args = self.args
        if not self.eval_batches:  # each rank tokenizes all of it, and keeps its share
            self.eval_batches.extend(iter_eval_batches(**self.data_source, batch_size=args.eval_batch_size,
                                                       eval_tokens=args.eval_tokens, rank=self.rank,
                                                       world_size=self.world_size))
        result = evaluation.evaluate(self.train_model if args.fsdp else self.model, self.eval_batches,
                                     device=self.device, eval_tokens=args.eval_tokens, autocast=self.autocast,
                                     lockstep=args.fsdp, show_progress=self.is_main)
        self.progress.last_eval = dict(result, step=self.progress.update_step)
        return self.progress.last_eval

    def save(self):
        """Every rank calls this; rank 0 writes, then tells every rank whether it worked (no rank is left waiting)."""
        run_dir, progress = self.run_dir, self.progress
        step = progress.update_step
        gathered = self.checkpointer.gather(run_dir, step, model=self.model, train_model=self.train_model,
                                            optimizer=self.optimizer, stream=self.stream)
        path = checkpointing.checkpoint_dir(run_dir, step)
        with failure_shared_by_every_rank(
                run_dir, no_space=f"run folder {run_dir}: no space left on device while saving {path}; removed the "
                                  f"partial checkpoint, the last good one is {progress.last_checkpoint or 'none'}",
                failed=f"rank 0 could not save {path}",
                on_failure=lambda: run_folder.remove_partial_checkpoints(run_dir)):
            if self.is_main:
                self.rank0_writes.raise_held()  # a row rank 0 failed to write: no checkpoint outlives it
                self.metrics.sync()  # a power loss may not keep a checkpoint without the rows up to it
                path = self.checkpointer.write(run_dir, step, gathered, export_model=self.export_model,
                                               tokenizer=self.tokenizer, scheduler=self.scheduler,
                                               tokens_seen=progress.tokens_seen, args=self.args)
        progress.last_checkpoint = path

    # ---- the end ------------------------------------------------------------------------------------------------
    def finish(self) -> ExitCode:
        """results.json, the plots and wandb's summary, written by rank 0; every rank leaves with the outcome."""
        progress = self.progress
        self.stream.close()
        if progress.last_eval is None and progress.status == "finished":  # resumed at the last step: no results yet
            self.evaluate()
        exit_code = {"finished": ExitCode.FINISHED, "diverged": ExitCode.DIVERGED,
                     "stopped": ExitCode.STOPPED}[progress.status]
        with failure_shared_by_every_rank(self.run_dir):
            if self.is_main:
                self.rank0_writes.raise_held()  # a row of the last update that rank 0 failed to write
                self.metrics.close()
                self.write_results(exit_code)
        return exit_code

    def write_results(self, exit_code: ExitCode):
        args, progress, finished = self.args, self.progress, self.progress.status == "finished"
        results = {
            "status": progress.status,
            "step": progress.update_step,
            "num_training_steps": args.num_training_steps,
            "final_eval_loss": progress.last_eval["eval_loss"] if finished else None,
            "final_eval_ppl": progress.last_eval["eval_ppl"] if finished else None,
            "eval_tokens": progress.last_eval["eval_tokens"] if finished else None,
            "tokens_seen": progress.tokens_seen,
            "diverged_reason": progress.diverged_reason,
            "stop_signal": self.stop.signal_name if progress.status == "stopped" else None,
            "norm_type": self.config.norm_type,
            "post_num": self.config.post_num,
            "model_config": args.model_config,
            "checkpoint": progress.last_checkpoint,
        }
        results_path = os.path.join(self.run_dir, "results.json")
        run_folder.write_json_atomic(results_path, {k: metrics_file.json_safe(v) for k, v in results.items()})
        plot_path = os.path.join(self.run_dir, "loss_curve.png")
        plots.plot_loss_curve(self.metrics_path, plot_path, title=f"{args.run_name} ({progress.status})")
        gains_plot_path = plots.plot_norm_gains(self.metrics_path, os.path.join(self.run_dir, "norm_gains.png"),
                                                title=f"{args.run_name}: mean RMSNorm gain per layer")
        wandb_dir = self.wandb_run.dir if self.wandb_run is not None else None
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in results.items() if v is not None})
            self.wandb_run.finish(exit_code=exit_code)
        print(f"\nstatus:     {progress.status} at update step {progress.update_step}"
              + (f" ({progress.diverged_reason})" if progress.diverged_reason else "")
              + (f"\neval:       loss {results['final_eval_loss']:.4f}, ppl {results['final_eval_ppl']:.2f} over "
                 f"{results['eval_tokens']} tokens" if finished else "")
              + f"\nrun folder: {self.run_dir}\nmetrics:    {self.metrics_path}\nresults:    {results_path}"
              + f"\nplot:       {plot_path}"
              + (f"\nnorm gains: {gains_plot_path}" if gains_plot_path else "")
              + f"\ncheckpoint: {progress.last_checkpoint or 'none'}"
              + (f"\nwandb:      {wandb_dir} ({wandb_logging.wandb_mode()})" if wandb_dir else ""),
              flush=True)


def train(args, rank: int, world_size: int, device, on_exit: contextlib.ExitStack) -> ExitCode:
    """Set-up, the loop, the results. Each update: train_step, then (unless it diverged) apply, a metrics row, an
    evaluation and a save when due; a stop signal ends the loop after a save."""
    try:
        run = Run(args, rank, world_size, device, on_exit)
    except AlreadyFinished:
        return ExitCode.FINISHED
    progress = run.progress
    run.log(f"training {args.num_training_steps - progress.update_step} updates of {args.total_batch_size} "
            f"sequences x {args.max_length} tokens (batch {args.batch_size} x accumulation "
            f"{args.gradient_accumulation} x world {world_size}); run folder {run.run_dir}")
    # Closed however the run ends, so that an error message gets a line of its own.
    bar = on_exit.enter_context(tqdm(total=args.num_training_steps, initial=progress.update_step,
                                     desc="update steps", ncols=100, disable=not run.is_main))
    first_update = progress.update_step + 1
    run.train_model.train()
    while progress.update_step < args.num_training_steps:
        update_start = time.perf_counter()
        update = run.train_step()
        row = {"step": progress.update_step + 1, "loss": update.loss, "lr": run.optimizer.param_groups[0]["lr"],
               "grad_norm": update.grad_norm}
        diverged = run.divergence(update)
        if diverged is not None:  # the update is never applied
            run.optimizer.zero_grad(set_to_none=True)
            progress.update_step += 1
            run.write_row(dict(row, tokens_seen=progress.tokens_seen, diverged=diverged))
            run.stop_as_diverged(diverged, "stopping (last checkpoint kept)")
            break
        run.apply(update)
        row.update(tokens_seen=progress.tokens_seen, tokens_per_s=update.tokens / (time.perf_counter() - update_start))
        if args.compile and progress.update_step == first_update:
            run.log(f"torch.compile: the first update took {time.perf_counter() - update_start:.1f} s, compilation "
                    f"included")
        last = progress.update_step == args.num_training_steps
        stopping = update.stop_requested and not last  # the last update finishes the run anyway
        saving = progress.update_step % args.save_every == 0 or last or stopping
        if saving and not optimization.parameters_finite(run.model, device):
            row["diverged"] = f"non-finite weights after update step {progress.update_step}"
        elif progress.update_step % args.eval_every == 0 or last:
            eval_result = run.evaluate()
            row.update(eval_loss=eval_result["eval_loss"], eval_ppl=eval_result["eval_ppl"],  # gains: every rank (FSDP)
                       norm_gain_mean=norm_gains.mean_norm_gains(run.model),
                       final_norm_gain_mean=norm_gains.final_norm_gain(run.model))
            run.log(f"step {progress.update_step}: eval loss {eval_result['eval_loss']:.4f} ppl "
                    f"{eval_result['eval_ppl']:.2f} over {eval_result['eval_tokens']} tokens")
        run.write_row(row)
        if run.is_main:
            bar.set_postfix(loss=f"{update.loss:.3f}", lr=f"{row['lr']:.2e}")
            bar.update(1)
        if "diverged" in row:
            run.stop_as_diverged(row["diverged"], "not saved (last checkpoint kept)")
            break
        if saving:
            run.save()
        if stopping:
            progress.status = "stopped"
            run.log(f"{run.stop.signal_name or 'a stop signal (on another rank)'}: stopped after update step "
                    f"{progress.update_step}; the same command with --resume auto (or --continue_from {run.run_dir}) "
                    f"continues the run")
            break
    bar.close()
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())

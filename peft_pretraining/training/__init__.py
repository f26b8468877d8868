"""The training runtime of torchrun_main.py: its flags, its run folder, the distributed set-up and what it logs.

    args_utils     every flag of torchrun_main.py, with one line per bad value
    run_folder     one process per run folder, recovery after a crash, which checkpoint resumes
    checkpointing  atomic saves and resumes (DCP for FSDP2), pruning old saves
    distributed    the process group, DDP / FSDP2 wrapping, gradient sync (kept out of the model)
    optimization   the optimizer, its schedule, the numbers of one update
    evaluation     the token-weighted evaluation loss
    rng            seeding, and the generators' states for an exact resume
    host_memory    glibc's keeping of freed memory in CPU runs
    norm_gains     the norms' mean gains by depth, as logged at each evaluation
    metrics_file   metrics.jsonl, written and read back
    wandb_logging  wandb's mode and the run folder's run id
    plots          the run folder's plots
"""

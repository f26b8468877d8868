"""The studies' library, shared by utils/compare_norms.py, utils/depth_sweep.py and utils/width_sweep.py, which hold
only their budgets, arms and report templates. No script imports another.

    cli        the flags every study takes, resolved into its settings and folders
    runs       a study's runs: train (torchrun_main.py), analyse, write the record; read records back
    records    a run record on disk (<name>.json.gz, compact): the one reader and writer; `convert` for older folders
    analyse    every instrument on one checkpoint (the analysis subprocess of a run)
    backfill   measures a committed record predates, added from a retrain that agrees with it
    replicate  which verdicts of a study survive a second run of it (another host), side by side
    lr_grid    a depth sweep trained at several --lr: each point's best rate, and the verdicts at the best rates
    results_table  the README's claims x regimes table, written from the committed summaries
    findings   the words a finding may use, each printed from an interval; the README's rendered answers
    pages      study pages whose answer, set-up and rebuild commands are rendered from the summaries
    multiplier what LNS is worth in compute: the updates Pre-LN needs to reach its loss, over its own
    rate_choice  learning rates chosen on a selection text that no verdict reads
    __main__   `python -m utils.study list | train NAME | report NAME|all | check`
    measures   the scalar measures a record's analyses are summarised into, per arm and seed
    claims     the paper's claims about LNS against Pre-LN as paired verdicts on two arms, and their report text
    sweep      what the depth and width sweeps share: the axis, configs, flags, slopes against ln of the swept value
    depth_verdicts  what a depth sweep's records say: the predictions' slopes against ln L, LNS against Pre-LN
                    comparatively, the regime (does depth pay?), the rivals against both
    verdicts   paired verdicts with an effect and its 95% interval
    plots      the figures every study draws, saved as small palette PNGs
    report     the report's shared lines: what made it, how complete, how long, where it is saved
    host       the machine a record was made on and the software a report was written with
"""

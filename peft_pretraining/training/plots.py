"""The run folder's plots, drawn from metrics.jsonl at the end of a run: the loss curve and the norm gains by depth."""
from peft_pretraining.training.metrics_file import read_metrics


def plot_loss_curve(metrics_path: str, png_path: str, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=4)
    ax.set_xlabel("update step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_norm_gains(metrics_path: str, png_path: str, title: str = "") -> str | None:
    """Mean norm gain against depth, one line per evaluation, coloured by update step (the final norm is the last
    point). Returns the path, or None when metrics.jsonl holds no gains."""
    rows = [r for r in read_metrics(metrics_path) if r.get("norm_gain_mean")]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    steps = [r["step"] for r in rows]
    colours = matplotlib.colors.Normalize(vmin=min(steps), vmax=max(max(steps), min(steps) + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    num_layers = len(rows[-1]["norm_gain_mean"])
    for row in rows:
        gains = list(row["norm_gain_mean"]) + [row.get("final_norm_gain_mean")]
        ax.plot(range(len(gains)), [float("nan") if g is None else g for g in gains], "o-", markersize=3,
                linewidth=1, color=plt.cm.viridis(colours(row["step"])))
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="initial gain 1.0")
    ticks = list(range(0, num_layers, max(1, num_layers // 8))) + [num_layers]
    ax.set_xticks(ticks, [str(t) for t in ticks[:-1]] + ["final"])
    ax.set_xlabel("decoder layer (0-based); last point: final norm")
    ax.set_ylabel("mean RMSNorm gain")
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=colours, cmap="viridis"), ax=ax, label="update step")
    bar.locator = matplotlib.ticker.MaxNLocator(integer=True)
    bar.update_ticks()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path

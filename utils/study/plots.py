"""The figures the study reports share: training dynamics and per-layer profiles."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from utils.study.measures import GROWTH_MEASURES, MEASURES, finite_or_none, measures_at, measures_in


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Screen resolution, and a 256-colour palette: a study figure of a few lines and labels reads the same at about a
# sixth of the bytes of a 140-dpi RGBA one, and every committed report folder carries several.
FIGURE_DPI = 100


def save_figure(fig, path: Path, dpi: int = FIGURE_DPI) -> Path:
    """Write `fig` to `path` as a palette PNG (deterministic: no timestamp, fixed quantiser) and close it."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None})
    pyplot().close(fig)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    return path


def finish_grid(fig, axes, panels_used: int, title: str, path: Path) -> Path:
    """Hide the unused panels of a grid, put the legend on the first, title, save and close the figure."""
    for ax in list(axes.flat)[panels_used:]:
        ax.axis("off")
    if axes.flat[0].get_legend_handles_labels()[0]:  # a report with no records yet has nothing to label
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_dynamics(records: dict[str, dict], arms: dict[str, str], path: Path, measures=None) -> Path:
    """Each measure against the training step: one line per arm (mean over seeds), shaded from min to max."""
    plt = pyplot()
    measures = list(measures or measures_in(records))
    cols = 3
    rows = math.ceil(len(measures) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, measure in zip(axes.flat, measures):
        for arm, label in arms.items():
            arm_records = [r for r in records.values() if r["arm"] == arm and r.get("analyses")]
            steps = sorted({int(s) for r in arm_records for s in r["analyses"]})
            series = [[finite_or_none(measures_at(r, s).get(measure)) if str(s) in r["analyses"] else None
                       for s in steps] for r in arm_records]
            points = [(s, [v[i] for v in series if v[i] is not None]) for i, s in enumerate(steps)]
            points = [(s, vals) for s, vals in points if vals]
            if not points:
                continue
            xs = [s for s, _ in points]
            line, = ax.plot(xs, [np.mean(v) for _, v in points], marker="o", markersize=3, label=label,
                            linestyle="--" if "bf16" in arm else "-")  # pure-bf16 arms often overlap mixed ones
            ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], alpha=0.2,
                            color=line.get_color())
        ax.set_title(MEASURES[measure], fontsize=9)
        ax.set_xlabel("update step")
        if measure in GROWTH_MEASURES:  # early in training the first layer's variance is tiny: ratios in the 1000s
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    return finish_grid(fig, axes, len(measures), "Training dynamics (line: mean over seeds; band: min to max)", path)


def plot_layer_profiles(records: dict[str, dict], arms: dict[str, str], path: Path) -> Path:
    """Per-layer measures at each run's last analysed checkpoint, mean over seeds."""
    import matplotlib.ticker

    plt = pyplot()
    # Layer 0 dwarfs the others in the last two panels: a symmetric log scale keeps the deep layers visible.
    panels = [("variance", "residual variance (0 = embeddings)", "log"), ("angular_next", "d(l, l+1)/pi", "linear"),
              ("jacobian_rel_identity_dev", "‖J − I‖_F / √d", "symlog"),
              ("removal_nats", "removal cost (nats/word)", "symlog")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.4))
    for ax, (key, title, scale) in zip(axes, panels):
        for arm, label in arms.items():
            curves = []
            for record in records.values():
                if record["arm"] == arm and record.get("analyses") and record["status"] == "finished":
                    last = max(record["analyses"], key=int)
                    curves.append([np.nan if v is None else v for v in record["analyses"][last][key]])
            if curves:
                width = min(len(c) for c in curves)
                ax.plot(np.nanmean([c[:width] for c in curves], axis=0), marker="o", markersize=2.5, label=label,
                        linestyle="--" if "bf16" in arm else "-")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-2)
        else:
            ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)

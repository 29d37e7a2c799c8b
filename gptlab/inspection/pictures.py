"""Pictures of what `attention` and `curves` read, drawn with matplotlib (the `viz` extra) on its Agg backend:
no display is needed, and nothing here imports matplotlib until a picture is drawn.

- `attention_picture`: one heatmap (a layer and a head), or a grid: a layer's heads, a head across the layers, or
  each layer's head-average; the prompt's tokens label the axes (rows: queries, columns: keys).
- `patching_picture`: the patching metric per layer and position (or head), the clean prompt's tokens below.
- `curves_picture`: train and val loss of several runs overlaid (each run its colour, val dashed with markers),
  the learning rate on a second axis (dotted).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_file
from gptlab.inspection.attention import AttentionMap
from gptlab.inspection.curves import Curve
from gptlab.inspection.patching import PatchingMap

DPI = 100
MAX_LABELS = 48  # more tokens than this: axis labels would overlap, so none are drawn


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a one-line install hint."""
    try:
        import matplotlib
    except ImportError:
        raise GptlabError("pictures need matplotlib: pip install 'gptlab[viz]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_png_path(path: str | Path) -> Path:
    """A PNG destination whose directory exists (checked before any slow work), and matplotlib installed."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise GptlabError(f"-o {path}: pictures are written as PNG; name the file *.png")
    if not path.parent.is_dir():
        raise GptlabError(f"-o {path}: the directory {path.parent} does not exist")
    pyplot()
    return path


def _save(fig: Any, path: str | Path) -> Path:
    path = check_png_path(path)
    try:
        atomic_write_file(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    finally:
        pyplot().close(fig)
    return path


def _label(token: str) -> str:
    return repr(token)[1:-1] or " "  # newlines and tabs visible, quotes dropped


def _heatmap(ax: Any, weights: Any, tokens: list[str], title: str, labels: bool) -> Any:
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    T = len(tokens)
    if labels and T <= MAX_LABELS:
        names = [_label(t) for t in tokens]
        ax.set_xticks(range(T), names, rotation=90, fontsize=7, family="monospace")
        ax.set_yticks(range(T), names, fontsize=7, family="monospace")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    return image


def attention_picture(amap: AttentionMap, path: str | Path, layer: int | None = None,
                      head: int | None = None) -> Path:
    """A PNG of the weights: one map for a layer and a head, else a grid (see the module docstring)."""
    plt = pyplot()
    selected = amap.select(layer, head)
    if layer is not None and head is not None:
        maps, titles = [selected], [f"layer {layer}, head {head}"]
    elif layer is not None:
        maps, titles = list(selected), [f"layer {layer}, head {h}" for h in range(amap.n_head)]
    elif head is not None:
        maps, titles = list(selected), [f"layer {i}, head {head}" for i in range(amap.n_layer)]
    else:
        maps, titles = list(selected), [f"layer {i}, mean of {amap.n_head} heads" for i in range(amap.n_layer)]
    cols = min(len(maps), 4)
    rows = math.ceil(len(maps) / cols)
    side = 4.2 if len(maps) == 1 else 3.2
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False, layout="constrained")
    for ax, w, title in zip(axes.flat, maps, titles, strict=False):
        image = _heatmap(ax, w, amap.tokens, title, labels=True)
    for ax in list(axes.flat)[len(maps):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight (row: query, column: key)")
    return _save(fig, path)


def patching_picture(pmap: PatchingMap, path: str | Path) -> Path:
    """A PNG of the patching metric: layers down, positions (the clean prompt's tokens) or heads across."""
    plt = pyplot()
    values = pmap.values
    layers, across = values.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * across + 2.5), max(3.0, 0.35 * layers + 1.5)),
                           layout="constrained")
    image = ax.imshow(values.numpy(), cmap="RdBu", interpolation="nearest", aspect="auto",
                      vmin=min(pmap.corrupt, pmap.clean, float(values.min())),
                      vmax=max(pmap.corrupt, pmap.clean, float(values.max())))
    heads = pmap.point == "attn.hook_z"
    ax.set_title(f"{pmap.point} patched into the corrupted run\nclean {pmap.clean:.2f}, corrupted {pmap.corrupt:.2f}",
                 fontsize=9)
    ax.set_ylabel("layer")
    ax.set_yticks(range(layers))
    if heads:
        ax.set_xlabel("head")
        ax.set_xticks(range(across))
    elif across <= MAX_LABELS:
        ax.set_xticks(range(across), [_label(t) for t in pmap.tokens], rotation=90, fontsize=7, family="monospace")
    fig.colorbar(image, ax=ax, shrink=0.8, label=f"logit {pmap.answer!r} - logit {pmap.wrong!r}")
    return _save(fig, path)


X_LABELS = {"step": "step", "tokens": "tokens", "time": "training time (s)"}


def curves_picture(curves: list[Curve], path: str | Path, x: str = "step") -> Path:
    """A PNG of the runs' loss curves, overlaid, with their learning rates on a second axis; below them, when a
    run logged rewards (DPO, IPO), the reward margin and accuracy, and when it logged benchmark scores, those."""
    plt = pyplot()
    rewards = any(c.reward_margin.x for c in curves)
    evals = any(c.evals for c in curves)
    rows = 1 + rewards + evals
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4.5 + 3 * (rows - 1)), layout="constrained", sharex=True,
                             squeeze=False)
    ax = axes[0, 0]
    lr_ax = ax.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(curves):
        color = colors[i % len(colors)]
        if c.train_loss.x:
            ax.plot(c.train_loss.x, c.train_loss.y, color=color, label=f"{c.name} train")
        if c.val_loss.x:
            ax.plot(c.val_loss.x, c.val_loss.y, color=color, linestyle="--", marker="o", markersize=4,
                    label=f"{c.name} val")
        if c.lr.x:
            lr_ax.plot(c.lr.x, c.lr.y, color=color, linestyle=":", alpha=0.7, label=f"{c.name} lr")
    ax.set_xlabel("" if rows > 1 else X_LABELS[x])
    ax.set_ylabel("loss")
    lr_ax.set_ylabel("learning rate (dotted)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    lr_handles, lr_labels = lr_ax.get_legend_handles_labels()
    ax.legend(handles + lr_handles, labels + lr_labels, fontsize=8, loc="upper right")
    if rewards:
        _reward_axes(axes[1, 0], curves, colors, X_LABELS[x] if not evals else "")
    if evals:
        _eval_axes(axes[rows - 1, 0], curves, X_LABELS[x])
    return _save(fig, path)


def _eval_axes(ax: Any, curves: list[Curve], x_label: str) -> None:
    """The benchmark scores logged during training (eval_tasks), one line per run and metric."""
    for c in curves:
        for key, series in sorted(c.evals.items()):
            ax.plot(series.x, series.y, marker="o", markersize=3, label=f"{c.name} {key.removeprefix('eval/')}")
    ax.set_xlabel(x_label)
    ax.set_ylabel("benchmark score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def _reward_axes(ax: Any, curves: list[Curve], colors: list[str], x_label: str) -> None:
    """Reward margin (solid) and reward accuracy (dashed, on a second axis from 0 to 1) of preference runs."""
    acc_ax = ax.twinx()
    for i, c in enumerate(curves):
        color = colors[i % len(colors)]
        if c.reward_margin.x:
            ax.plot(c.reward_margin.x, c.reward_margin.y, color=color, label=f"{c.name} reward margin")
        if c.reward_accuracy.x:
            acc_ax.plot(c.reward_accuracy.x, c.reward_accuracy.y, color=color, linestyle="--", alpha=0.7,
                        label=f"{c.name} reward accuracy")
    ax.set_xlabel(x_label)
    ax.set_ylabel("reward margin (chosen - rejected)")
    acc_ax.set_ylabel("reward accuracy (dashed)")
    acc_ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    acc_handles, acc_labels = acc_ax.get_legend_handles_labels()
    ax.legend(handles + acc_handles, labels + acc_labels, fontsize=8, loc="upper left")

"""Hit rate vs coverage, one line per policy, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_hit_rates(curves: Mapping[str, Sequence[tuple[float, float]]], path: str | Path,
                   title: str) -> Path:
    """curves: label -> [(coverage, hit rate)], both fractions. Writes and returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    styles = {"belady": dict(color="black", linestyle="--"), "static": dict(color="tab:gray")}
    for label, points in curves.items():
        xs = [100 * c for c, _ in points]
        ys = [100 * h for _, h in points]
        ax.plot(xs, ys, marker="o", markersize=3, label=label, **styles.get(label, {}))
    ax.set_xlabel("coverage (slots / pairs, %)")
    ax.set_ylabel("decode hit rate (%)")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path

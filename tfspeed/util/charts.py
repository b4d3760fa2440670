"""Bar charts as PNG files a person can look at (matplotlib, no display needed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Panel:
    """One set of bars: a bar per label for each series, side by side where there are several.

    Attributes:
      labels: what each bar (or group of bars) stands for.
      series: legend name -> one value per label; a lone series named "" gets no legend.
      value_label: the value axis' title.
      title: the panel's title.
      horizontal: labels down the side, the first on top; else along the bottom.
      colors: one colour per series, or, for a lone series, one per bar; None: the defaults.
      reference: ``(name, value)``: a dashed line across the bars at ``value``, in the legend.
      font_size: of the labels and the legend; None: matplotlib's.
    """

    labels: Sequence[str]
    series: Mapping[str, Sequence[float]]
    value_label: str = ""
    title: str = ""
    horizontal: bool = True
    colors: Sequence[str] | None = None
    reference: tuple[str, float] | None = None
    font_size: float | None = None


def bar_chart(path: str, panels: Sequence[Panel], size: tuple[float, float]) -> str:
    """Draws ``panels`` side by side into a PNG at ``path`` (100 dpi).

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=size, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        _draw(ax, panel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw(ax, panel: Panel) -> None:
    positions = range(len(panel.labels))
    count = len(panel.series)
    width = 0.8 / count if count > 1 else 0.8
    bars = ax.barh if panel.horizontal else ax.bar
    for j, (name, values) in enumerate(panel.series.items()):
        shift = ((count - 1) / 2 - j) * width
        color = (panel.colors if count == 1 else panel.colors[j]) if panel.colors else None
        bars([p + shift for p in positions], list(values), width, label=name or None,
             color=color)
    if panel.reference:
        line = ax.axvline if panel.horizontal else ax.axhline
        line(panel.reference[1], color="k", ls="--", label=panel.reference[0])
    if panel.horizontal:
        ax.set_yticks(list(positions), list(panel.labels), fontsize=panel.font_size)
        ax.invert_yaxis()
        ax.set_xlabel(panel.value_label)
    else:
        ax.set_xticks(list(positions), list(panel.labels), fontsize=panel.font_size)
        ax.set_ylabel(panel.value_label)
    if panel.title:
        ax.set_title(panel.title)
    if any(panel.series) or panel.reference:
        ax.legend(fontsize=panel.font_size)

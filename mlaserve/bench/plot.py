"""PNG charts of benchmark runs against client concurrency (`bench serving --plot`, benchmarks/ablation.py --plot).

matplotlib is an optional extra (`pip install 'mlaserve[plot]'`); `missing_matplotlib()` says so in one line.
"""
from __future__ import annotations

from typing import Any, NamedTuple

PLOT_EXTRA = "pip install 'mlaserve[plot]' (or: pip install matplotlib)"


class Panel(NamedTuple):
    """One chart: `lines` maps a legend label to its (x, y) points; y None is a missing point (left out)."""

    title: str
    ylabel: str
    lines: dict[str, list[tuple[float, float | None]]]


def missing_matplotlib(flag: str = "--plot") -> str | None:
    """One line saying how to get matplotlib when it cannot be imported, else None."""
    try:
        import matplotlib  # noqa: F401  (only whether it imports)
    except ImportError:
        return f"{flag} needs matplotlib, which is not installed: {PLOT_EXTRA}"
    return None


def draw(panels: list[Panel], path: str, title: str = "", xlabel: str = "client concurrency") -> None:
    """Panels side by side, x on a log2 scale (concurrency 1, 16, 64 spread evenly), written to `path` (PNG)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        xs_all = set()
        for label, points in panel.lines.items():
            pts = sorted((x, y) for x, y in points if y is not None)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
                xs_all |= {x for x, _ in pts}
        ax.set_title(panel.title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(panel.ylabel)
        if xs_all and min(xs_all) > 0 and max(xs_all) > min(xs_all):
            ax.set_xscale("log", base=2)
        if xs_all:
            ax.set_xticks(sorted(xs_all), [f"{x:g}" for x in sorted(xs_all)])
        ax.grid(True, alpha=0.3)
        if panel.lines:
            ax.legend(fontsize="small")
    _save(plt, fig, path, title)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")                     # NOTE: no display: render to the file only
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: str, title: str) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class BarPanel(NamedTuple):
    """One horizontal bar chart: a bar group per category (top to bottom), a bar per series in each group; None
    is a missing bar (left out)."""

    title: str
    xlabel: str
    categories: list[str]
    series: dict[str, list[float | None]]


def draw_bars(panels: list[BarPanel], path: str, title: str = "") -> None:
    """Panels side by side sharing the category axis (the first panel labels it), written to `path` (PNG)."""
    plt = _pyplot()
    n = max(len(p.categories) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 2.5, 0.42 * n + 1.6), squeeze=False,
                             sharey=True)
    for ax, panel in zip(axes[0], panels):
        k = max(len(panel.series), 1)
        height = 0.8 / k
        for j, (name, values) in enumerate(panel.series.items()):
            ys = [i - 0.4 + height * (j + 0.5) for i, v in enumerate(values) if v is not None]
            ax.barh(ys, [v for v in values if v is not None], height=height, label=name)
        ax.set_yticks(range(len(panel.categories)), panel.categories, fontsize="small")
        ax.invert_yaxis()
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.grid(True, axis="x", alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize="small")
    _save(plt, fig, path, title)


def serving_panels(records: list[dict[str, Any]]) -> list[Panel]:
    """`bench serving` records (one per --max-concurrency level) -> throughput, TTFT and TPOT / ITL panels."""
    def series(key: str) -> list[tuple[float, float | None]]:
        return [(_level(r), r.get(key)) for r in records]

    return [Panel("throughput", "tokens / s", {"output": series("output_throughput"),
                                               "total (input + output)": series("total_throughput")}),
            Panel("time to first token", "ms", {"median": series("median_ttft_ms"), "p99": series("p99_ttft_ms")}),
            Panel("time per output token", "ms", {"TPOT median": series("median_tpot_ms"),
                                                  "TPOT p99": series("p99_tpot_ms"),
                                                  "ITL median": series("median_itl_ms"),
                                                  "ITL p99": series("p99_itl_ms")})]


def _level(record: dict[str, Any]) -> float:
    """The run's client concurrency: --max-concurrency, else what it measured (sum of latencies / duration)."""
    return float(record.get("max_concurrency") or round(record.get("concurrency") or 1, 1))

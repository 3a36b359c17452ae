"""PNG plots of bench and tune results (matplotlib's Agg canvas, no pyplot, no display).

matplotlib is imported inside the functions: importing this module costs nothing, and the
laptop CLI works without matplotlib until a plot is asked for. Every function writes one PNG
and returns its path. `plot_sweep` and `plot_panels` are generic (x values against named
series) so `cluster tune` draws its parameter sweeps with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

Number = float | int
Series = Mapping[str, Sequence[Number | None]]


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, per figure: no global backend switch, no pyplot
    return fig


def _draw(ax: Any, x_values: Sequence[Number], series: Series, xlabel: str, ylabel: str,
          title: str | None, log_x: bool) -> None:
    for name, values in series.items():
        if len(values) != len(x_values):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(x_values)} x values")
        points = [(x, y) for x, y in zip(x_values, values) if y is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    if log_x and len(x_values) > 1 and min(x_values) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(x_values))
    ax.set_xticklabels([f"{x:g}" for x in x_values])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend()


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def plot_sweep(x_values: Sequence[Number], series: Series, xlabel: str, ylabel: str,
               path: str | Path, title: str = "", *, log_x: bool = False) -> Path:
    """One chart: each named series against x_values (None values are left out)."""
    fig = _figure(7, 4.5)
    _draw(fig.add_subplot(1, 1, 1), x_values, series, xlabel, ylabel, title or None, log_x)
    return _save(fig, path)


def plot_panels(x_values: Sequence[Number], panels: Sequence[tuple[str, str, Series]],
                xlabel: str, path: str | Path, title: str = "", *, log_x: bool = False) -> Path:
    """Side-by-side charts sharing x_values; each panel is (panel title, y label, series)."""
    fig = _figure(5 * max(1, len(panels)), 4.5)
    for i, (panel_title, ylabel, series) in enumerate(panels, start=1):
        _draw(fig.add_subplot(1, len(panels), i), x_values, series, xlabel, ylabel,
              panel_title, log_x)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _levels(result: Any) -> list[Mapping[str, Any]]:
    """Levels as dicts, from a BenchResult or its to_dict()."""
    doc = result.to_dict() if hasattr(result, "to_dict") else result
    return list(doc["levels"])


def _title(result: Any, what: str) -> str:
    doc = result.to_dict() if hasattr(result, "to_dict") else result
    return (f"{what}: {doc.get('model', '')} ({doc.get('endpoint', '')}, prompt "
            f"{doc.get('prompt_len', '?')} / output {doc.get('output_len', '?')} tokens)")


def plot_latency_vs_concurrency(result: Any, path: str | Path) -> Path:
    """TTFT, ITL and E2E p50 & p95 (ms) against concurrency, one panel each."""
    levels = _levels(result)
    x = [lv["concurrency"] for lv in levels]
    panels = []
    for key, name in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
                      ("e2e_ms", "end-to-end latency")):
        panels.append((name, "ms", {q: [lv[key][q] for lv in levels] for q in ("p50", "p95")}))
    return plot_panels(x, panels, "concurrency", path, _title(result, "latency"), log_x=True)


def plot_throughput_vs_concurrency(result: Any, path: str | Path) -> Path:
    """Output (and total) tokens/s and requests/s against concurrency."""
    levels = _levels(result)
    x = [lv["concurrency"] for lv in levels]
    panels = [
        ("tokens/s", "tokens/s", {"output": [lv["output_tokens_per_s"] for lv in levels],
                                  "total": [lv["total_tokens_per_s"] for lv in levels]}),
        ("requests/s", "requests/s", {"requests/s": [lv["requests_per_s"] for lv in levels]}),
    ]
    return plot_panels(x, panels, "concurrency", path, _title(result, "throughput"), log_x=True)


def write_bench_plots(result: Any, out_dir: str | Path) -> list[Path]:
    """latency.png and throughput.png in out_dir."""
    out = Path(out_dir)
    return [plot_latency_vs_concurrency(result, out / "latency.png"),
            plot_throughput_vs_concurrency(result, out / "throughput.png")]

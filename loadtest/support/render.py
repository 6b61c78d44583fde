"""Reports made visible: PNG plots (matplotlib) and one self-contained HTML page.

The same functions draw one report (a run of ``burst``, ``rate``, ``mix`` or ``replay``) and
several (``compare``): each is a list of named reports, and each step of each is a *series*
(a line in every plot):

* ``latency_cdf.png``: the CDF of time to first token, one panel per class;
* ``timeline.png``: requests in flight (the governor's own count where there is one, else the
  client's outstanding requests) and yields per second, over the run;
* ``goodput.png``: goodput and throughput against offered load, a point per step.

The HTML page embeds the PNGs (base64) and holds the tables, so it opens anywhere, offline.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import REQUEST_FIELDS, table

Named = Sequence[tuple[str, dict[str, Any]]]

_CLS, _STATUS, _TTFT = (REQUEST_FIELDS.index(k) for k in ("cls", "status", "ttft_ms"))


def _series(reports: Named) -> list[tuple[str, dict[str, Any]]]:
    """(label, step) for every step of every report."""
    out = []
    for name, report in reports:
        steps = report["steps"]
        for s in steps:
            label = name if len(steps) == 1 else f"{name} {s['label']}"
            out.append((label if len(reports) > 1 else s["label"], s))
    return out


def _pyplot() -> Any:
    import matplotlib  # here, not at the top: a run with --no-plots never loads it

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(reports: Named, path: Path) -> None:
    plt = _pyplot()
    series = _series(reports)
    classes = sorted({row[_CLS] for _, s in series for row in s["requests"]})
    fig, axes = plt.subplots(
        1, max(len(classes), 1), figsize=(5 * max(len(classes), 1), 4), squeeze=False
    )
    for ax, cls in zip(axes[0], classes, strict=False):
        for label, s in series:
            values = sorted(
                row[_TTFT]
                for row in s["requests"]
                if row[_CLS] == cls and row[_STATUS] == "done" and row[_TTFT] is not None
            )
            if values:
                n = len(values)
                shares = [(i + 1) / n for i in range(n)]
                ax.step([values[0], *values], [0.0, *shares], where="post", label=label)
        ax.set_title(f"{cls}: time to first token (done requests)")
        ax.set_xlabel("ms from first send (yields and retries included)")
        ax.set_ylabel("share of requests")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(reports: Named, path: Path) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for label, s in _series(reports):
        t = s["timeline"]
        if t["server_inflight"]:
            xs, ys = zip(*t["server_inflight"], strict=True)
            top.step(xs, ys, where="post", label=f"{label}: inflight (server)")
        if t["outstanding"]:
            xs, ys = zip(*t["outstanding"], strict=True)
            top.step(xs, ys, where="post", linestyle=":", label=f"{label}: outstanding (client)")
        # Yields per second in bins of a second, or of 0.1 s for runs under 20 s.
        width = 1.0 if s["duration_s"] >= 20 else 0.1
        bins = int(s["duration_s"] / width) + 1
        counts = [0] * bins
        for y in t["yields_s"]:
            counts[min(int(y / width), bins - 1)] += 1
        bottom.step(
            [i * width for i in range(bins)], [c / width for c in counts], where="post", label=label
        )
    top.set_ylabel("requests")
    top.set_title("in flight over time")
    _legend(top)
    top.grid(alpha=0.3)
    bottom.set_ylabel("yields per second")
    bottom.set_xlabel("seconds from the start")
    bottom.grid(alpha=0.3)
    _legend(bottom)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_goodput(reports: Named, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, report in reports:
        steps = sorted(report["steps"], key=lambda s: s["offered_rps"])
        xs = [s["offered_rps"] for s in steps]
        line = ax.plot(xs, [s["goodput_rps"] for s in steps], marker="o", label=f"{name} goodput")
        ax.plot(
            xs,
            [s["all"]["throughput_rps"] for s in steps],
            marker="x",
            linestyle="--",
            color=line[0].get_color(),
            label=f"{name} throughput",
        )
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("requests/s")
    ax.set_title("goodput (done within the objectives) against offered load")
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = {
    "latency_cdf.png": plot_cdf,
    "timeline.png": plot_timeline,
    "goodput.png": plot_goodput,
}


def write_plots(reports: Named, directory: Path) -> list[Path]:
    paths = []
    for filename, draw in PLOTS.items():
        path = directory / filename
        draw(reports, path)
        paths.append(path)
    return paths


def write_html(reports: Named, directory: Path, plots: Sequence[Path], title: str) -> Path:
    """``report.html``: the settings, every step's table, and the plots inline."""
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{esc(title)}</title><style>",
        "body{font-family:sans-serif;margin:2em;max-width:1200px}"
        "pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:13px}"
        "img{max-width:100%;border:1px solid #ddd;margin:.5em 0}"
        "td,th{padding:2px 8px;text-align:left;border-bottom:1px solid #eee}",
        f"</style></head><body><h1>{esc(title)}</h1>",
    ]
    for name, report in reports:
        parts.append(
            f"<h2>{esc(name)}</h2><table>"
            + "".join(
                f"<tr><th>{esc(k)}</th><td>{esc(str(report.get(k)))}</td></tr>"
                for k in ("command", "target", "addr", "date", "machine")
            )
            + f"<tr><th>settings</th><td><code>{esc(json.dumps(report['settings']))}</code></td></tr>"
            + f"<tr><th>objectives</th><td><code>{esc(json.dumps(report['slo']))}</code></td></tr>"
            + "</table>"
        )
        for s in report["steps"]:
            parts.append(
                f"<h3>{esc(s['label'])}: goodput {s['goodput_rps']}/s, offered "
                f"{s['offered_rps']}/s</h3><pre>{esc(chr(10).join(table(s)))}</pre>"
            )
    parts.append("<p>Latencies: p50/p90/p99/max in ms.</p>")
    for path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(
            f"<h2>{esc(path.stem)}</h2><img alt='{esc(path.name)}' src='data:image/png;base64,{data}'>"
        )
    parts.append("</body></html>")
    out = directory / "report.html"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def output_dir(given: str | None, command: str) -> Path:
    """``--out``, or ``loadtest-out/COMMAND-TIME`` when it was not given."""
    return Path(
        given or Path("loadtest-out") / f"{command}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    )


def write_outputs(
    out: Path, filename: str, data: dict[str, Any], reports: Named, *, plots: bool, title: str
) -> None:
    """``data`` as JSON in ``out/filename``, then (with ``plots``) the PNGs and the HTML page."""
    out.mkdir(parents=True, exist_ok=True)
    (out / filename).write_text(json.dumps(data) + "\n", encoding="utf-8")
    if plots:
        write_html(reports, out, write_plots(reports, out), title)


def _legend(ax: Any) -> None:
    """A legend where something is labelled (a run with no done request draws no curve)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")

"""The table, files and plot of `quantkit bench serve`: Markdown, JSON and PNG of one or more runs."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Optional

from quantkit.server.bench_serve import BenchRun

# (row key, column header, decimals)
COLUMNS = (
    ("concurrency", "Batch", 0),
    ("latency_s", "Latency/s", 3),
    ("request_throughput", "Request throughput/s", 2),
    ("input_throughput", "Input token throughput/s", 1),
    ("output_throughput", "Output token throughput/s", 1),
    ("mean_ttft_ms", "Mean TTFT ms", 1),
    ("p99_ttft_ms", "P99 TTFT ms", 1),
    ("mean_tpot_ms", "Mean TPOT ms", 2),
    ("p99_tpot_ms", "P99 TPOT ms", 2),
    ("failed", "Failed", 0),
)


def _cell(value: Any, decimals: int) -> str:
    if value is None:
        return "-"
    return f"{value:,.{decimals}f}" if isinstance(value, float) else str(value)


def markdown_table(runs: list[BenchRun]) -> str:
    """One Markdown table of every run's rows; a Server column first when there are several runs."""
    many = len(runs) > 1
    head = (["Server"] if many else []) + [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if h != "Server" else "---" for h in head) + "|"]
    for run in runs:
        for row in run.rows:
            cells = ([run.label] if many else []) + [_cell(row.get(k), d) for k, _, d in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(runs: list[BenchRun]) -> str:
    """The lines under the table: each run's server and settings, how tokens were counted, its notes
    and every failure message with its count."""
    out = []
    for run in runs:
        s = run.settings
        counted = sorted({f"output tokens from {r['output_tokens_from']}" for r in run.rows if r["output_tokens_from"]}
                         | {f"input tokens from {r['input_tokens_from']}" for r in run.rows if r["completed"]})
        out.append(f"- {run.label}: {run.url}{s['endpoint_path']}, model {run.model}, dataset {s['dataset']}, "
                   f"input {s['input_len']} / output {s['output_len']} tokens, ignore_eos "
                   f"{'sent' if s['ignore_eos_sent'] else 'not sent'}; {', '.join(counted) or 'no request completed'}")
        for note in run.notes:
            out.append(f"  - note: {note}")
        for row in run.rows:
            for msg, n in row["errors"].items():
                out.append(f"  - concurrency {row['concurrency']}: {n} of {row['requests']} failed: {msg}")
    return "\n".join(out)


def report_text(runs: list[BenchRun]) -> str:
    return markdown_table(runs) + "\n\n" + describe(runs) + "\n"


def write_report(runs: list[BenchRun], out_dir: str | Path, stem: str = "bench_serve",
                 plot: bool = True) -> dict[str, Optional[Path]]:
    """Write STEM.md (table and notes), STEM.json (every field of every row) and STEM.png (the plot,
    when matplotlib is installed) under `out_dir`; returns their paths (png None when skipped)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = out / f"{stem}.md"
    md.write_text(f"# quantkit bench serve, {date}\n\n" + report_text(runs), encoding="utf-8")
    js = out / f"{stem}.json"
    js.write_text(json.dumps({"date": date, "runs": [r.to_dict() for r in runs]}, indent=2) + "\n",
                  encoding="utf-8")
    png = out / f"{stem}.png"
    return {"md": md, "json": js, "png": png if plot and plot_runs(runs, png) else None}


def load_runs(path: str | Path) -> list[BenchRun]:
    """The runs of a JSON file written by write_report (to put an earlier run beside a new one)."""
    from quantkit.config import UserError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return [BenchRun(**r) for r in data["runs"]]
    except FileNotFoundError:
        raise UserError(f"--compare {path}: no such file") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"--compare {path}: not a JSON file written by quantkit bench serve ({exc})") from None


def plot_runs(runs: list[BenchRun], path: Path) -> bool:
    """Output throughput, TTFT and TPOT (mean solid, P99 dashed) against concurrency; False (and one
    line on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print("matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
        return False
    from matplotlib.ticker import NullLocator

    levels = sorted({r["concurrency"] for run in runs for r in run.rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("output_throughput", None, "output tokens/s"), ("mean_ttft_ms", "p99_ttft_ms", "TTFT (ms)"),
              ("mean_tpot_ms", "p99_tpot_ms", "TPOT (ms)"))
    for ax, (mean_key, p99_key, title) in zip(axes, panels):
        for i, run in enumerate(runs):
            color = f"C{i}"
            for key, style, tag in ((mean_key, "-o", "mean"), (p99_key, "--x", "P99")):
                pts = [(r["concurrency"], r[key]) for r in run.rows if key and r.get(key) is not None]
                if pts:
                    label = run.label if key == mean_key and p99_key is None else f"{run.label} {tag}"
                    ax.plot(*zip(*pts), style, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

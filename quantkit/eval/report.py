"""A comparison of models (`Comparison`, the rows eval/compare.py measures) and its renderings: a rich table
for the terminal, a Markdown table, a PNG bar chart (perplexity, and task accuracy when tasks were run)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

NO_CHART = "(No chart: matplotlib is not installed; `pip install matplotlib` adds it.)"


@dataclass
class ModelRow:
    """One model under one KV-cache setting; the last three fields are against the reference row."""

    name: str
    path: str
    method: str
    bits: int
    group_size: Optional[int]
    kv: str
    size_bytes: int
    size_note: str = ""
    ppl: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    delta_pct: dict[str, float] = field(default_factory=dict)
    kl: dict[str, float] = field(default_factory=dict)  # mean KL(reference ‖ row), nats per token
    top1: dict[str, float] = field(default_factory=dict)  # share of tokens whose argmax is the reference's
    tasks: dict[str, Any] = field(default_factory=dict)  # task → accuracy.TaskResult
    task_delta: dict[str, Any] = field(default_factory=dict)  # task → accuracy.PairedDiff against the reference row


@dataclass
class Comparison:
    """Rows in the order evaluated; `reference` says what the Δ %, KL and top-1 columns are against."""

    rows: list[ModelRow]
    datasets: list[str]
    seqlen: int
    windows: Optional[int]
    reference: Optional[str] = None
    written: list[str] = field(default_factory=list)  # report files (compare's `output`): .md, and .png if drawn
    tasks: list[str] = field(default_factory=list)  # accuracy tasks, in the order run
    task_limit: Optional[int] = None  # documents per task (MMLU: per subject); None: all
    num_fewshot: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _group(row: ModelRow) -> str:
    return {None: "—", -1: "channel", 0: "tensor"}.get(row.group_size, str(row.group_size))


def table_rows(result: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by every rendering: per dataset, perplexity and, where a row has a
    reference, Δ %, mean KL divergence and top-1 agreement against it."""
    header = ["model", "method", "W bits", "group", "KV cache", "size (MB)"]
    against = bool(result.reference)
    for d in result.datasets:
        header.append(f"ppl {d}")
        if against:
            header += [f"Δ % {d}", f"KL {d}", f"top-1 {d}"]
    headline = {t: next((r.tasks[t].headline for r in result.rows if t in r.tasks), "acc") for t in result.tasks}
    for t in result.tasks:
        header.append(f"{t} {headline[t]} %")
        if against:
            header.append(f"Δ {t} [95 %] −/+")
    cells = []
    for row in result.rows:
        size = f"{row.size_bytes / 1e6:.1f}" + ("*" if row.size_note else "")
        line = [row.name, row.method, str(row.bits), _group(row), row.kv, size]
        for d in result.datasets:
            line.append(f"{row.ppl[d]:.3f}")
            if against:
                line.append(f"{row.delta_pct[d]:+.2f}" if d in row.delta_pct else "—")
                line.append(f"{row.kl[d]:.4f}" if d in row.kl else "—")
                line.append(f"{100 * row.top1[d]:.1f} %" if d in row.top1 else "—")
        for t in result.tasks:
            r = row.tasks.get(t)
            line.append(f"{100 * r.metrics[r.headline]:.1f} ± {100 * r.stderr[r.headline]:.1f}" if r else "—")
            if against:
                line.append(_paired(row.task_delta[t]) if t in row.task_delta else "—")
        cells.append(line)
    return header, cells


def _paired(d: Any) -> str:
    """A paired difference in points: "-1.2 [-2.5, +0.1] −9/+3"."""
    return f"{100 * d.diff:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] −{d.lost}/+{d.gained}"


def _footnotes(result: Comparison) -> list[str]:
    notes = [f"Perplexity: test split, seqlen {result.seqlen}, "
             f"{'all' if result.windows is None else f'first {result.windows}'} non-overlapping windows."] \
        if result.datasets else []
    notes += sorted({f"* {r.size_note}." for r in result.rows if r.size_note})
    if result.tasks:
        docs = "all documents" if result.task_limit is None else f"the first {result.task_limit} documents"
        notes.append(f"Tasks: lm-evaluation-harness's prompts and metrics, {result.num_fewshot}-shot, {docs} of "
                     "each (MMLU: of each subject); ± is the standard error. Δ is the row minus the reference on "
                     "the same documents, in points, with its 95 % interval from the paired per-document outcomes; "
                     "−/+ count the documents the row got wrong that the reference got right, and the reverse.")
    if result.reference and result.datasets:
        notes.append(f"Δ %, KL and top-1 are against {result.reference}: KL is the mean over predicted tokens of "
                     "KL(reference ‖ row) of the next-token distributions, in nats; top-1 the share of tokens "
                     "whose most likely next token is the reference's (llama.cpp's --kl-divergence).")
    return notes


def print_table(result: Comparison, title: Optional[str] = None) -> None:
    """Print the comparison with rich."""
    from rich.console import Console
    from rich.table import Table

    header, cells = table_rows(result)
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i < 5 else "right")
    for line in cells:
        table.add_row(*line)
    console = Console()
    if not console.is_terminal:  # piped into a file or a log: no terminal width to fit, keep rows whole
        console = Console(width=200)
    console.print(table)
    for n in _footnotes(result):
        console.print(n, style="dim")


def markdown_table(result: Comparison) -> str:
    header, cells = table_rows(result)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines) + "\n\n" + "\n".join(_footnotes(result)) + "\n"


def _bars(ax, labels: list[str], groups: list[str], values: list[list[float]], fmt: str) -> None:
    """Grouped bars on `ax`: values[j][i] is group j's bar of label i."""
    n = len(groups)
    width = 0.8 / n
    for j, (g, vals) in enumerate(zip(groups, values)):
        bars = ax.bar([i + (j - (n - 1) / 2) * width for i in range(len(labels))], vals, width, label=g)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    if n > 1:
        ax.legend(fontsize=7)


def plot_perplexity(result: Comparison, png: Path) -> Path:
    """Grouped bars: perplexity per model and KV setting, one colour per dataset; beside it, with tasks, each
    task's headline accuracy."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window (servers, CI)
    import matplotlib.pyplot as plt

    labels = [r.name if r.kv == "KV16" else f"{r.name}\n{r.kv}" for r in result.rows]
    panels = int(bool(result.datasets)) + int(bool(result.tasks))
    fig, axes = plt.subplots(1, panels, figsize=(panels * max(5.0, 1.3 * len(labels) + 1), 3.8), squeeze=False)
    axes = list(axes[0])
    if result.datasets:
        ax = axes.pop(0)
        _bars(ax, labels, result.datasets, [[r.ppl[d] for r in result.rows] for d in result.datasets], "%.2f")
        ax.set_ylabel(f"perplexity (seqlen {result.seqlen})")
        ax.set_title("Perplexity by model (lower is better)")
    if result.tasks:
        ax = axes.pop(0)
        _bars(ax, labels, result.tasks, [[100 * r.tasks[t].metrics[r.tasks[t].headline] for r in result.rows]
                                         for t in result.tasks], "%.1f")
        ax.set_ylabel("accuracy % (acc_norm where lm-eval reports it)")
        ax.set_title("Task accuracy by model (higher is better)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def write_report(result: Comparison, output: Path) -> tuple[Path, Optional[Path]]:
    """Write the Markdown report to `output` and its chart beside it (same name, .png); returns both
    paths. matplotlib is optional (`pip install matplotlib`, or the `demo` extra): without it the
    report is written without the chart, says so, and the chart's path is None."""
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        png = None
        log.warning("no chart: matplotlib is not installed (pip install matplotlib); wrote the table only")
        chart = f"\n{NO_CHART}\n"
    else:
        png = plot_perplexity(result, output.with_suffix(".png"))
        chart = f"\n![comparison]({png.name})\n"
    output.write_text("# quantkit comparison\n\n" + markdown_table(result) + chart)
    return output, png

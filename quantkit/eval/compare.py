"""Perplexity (and, with `tasks`, task accuracy: eval/accuracy.py) of several models and KV-cache settings by one protocol, through the engine (the decoder
and paged KV pool `serve` runs; transformers' own model with `reference`), and how far each row is from
a reference row, per dataset: Δ % of perplexity, the mean KL divergence of its next-token distributions
and top-1 agreement (eval/divergence.py). The rows and their rendering live in eval/report.py.

`compare`: the reference is the fp model with an unquantized pool (KV16); every model is loaded at
once, and each window is run by every row in turn, so only the reference's logits of one window are
held. `evaluate_models` (`eval ppl`): one model at a time; its KV16 row is the reference of its
quantized-KV rows (added when only KV8/KV4 are asked for).
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from quantkit.config import UserError, check_device
from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.engine.config import EngineConfig
from quantkit.eval.divergence import Divergence
from quantkit.eval.loading import EvalModel, load_engine_model, load_reference_model
from quantkit.eval.perplexity import reference_logits, window_nll
from quantkit.eval.report import Comparison, ModelRow, write_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSettings:
    """How the engine's pool codes K and V beyond its bits (EngineConfig's fields of the same names)."""

    scales: str = "online"
    stats: Optional[str] = None  # a statistics file or directory for static scales; None: each model's own
    rotation: str = "auto"


@dataclass
class _Setting:
    """A row and what gives its logits of one window."""

    em: EvalModel
    row: ModelRow
    logits: Callable[[torch.Tensor], torch.Tensor]
    kv_bits: int = 16


def _settings(em: EvalModel, kv_bits: Sequence[int], kv: KVSettings, seqlen: int) -> list[_Setting]:
    """One setting per KV bits: an engine runner each (its own pool), or the transformers model once."""
    from quantkit.eval.engine_perplexity import engine_runner, kv_label, window_logits

    def row(label: str) -> ModelRow:
        return ModelRow(em.name, em.path, em.method, em.bits, em.group_size, label, em.size_bytes, em.size_note)

    if em.reference:
        return [_Setting(em, row("KV16 (transformers)"), partial(reference_logits, em.model))]
    out = []
    for b in kv_bits:
        stats = None
        if kv.scales == "static" and b != 16:
            from quantkit.engine.kv_scales import stats_file_for

            stats = str(stats_file_for(em.path, kv.stats))
        runner = engine_runner(em.model, b, seqlen, kv_scales=kv.scales, kv_stats=stats, kv_rotation=kv.rotation)
        out.append(_Setting(em, row(kv_label(runner)), partial(window_logits, runner), b))
    return out


def _measure(settings: list[_Setting], texts: dict[str, str], seqlen: int, windows: Optional[int],
             progress: bool, reference: bool) -> None:
    """Fill each row's perplexity per dataset; with `reference`, settings[0] is the reference row and the
    others whose windows are the same tokens get KL and top-1 against it."""
    for name, text in texts.items():
        tokens: dict[str, torch.Tensor] = {}
        for s in settings:  # tokenized once per model
            if s.em.path not in tokens:
                tokens[s.em.path] = evaluation_windows(tokenize_text(s.em.tokenizer, text), seqlen, windows)
        wins = [tokens[s.em.path] for s in settings]
        divs = [Divergence() if reference and j and torch.equal(w, wins[0]) else None for j, w in enumerate(wins)]
        nll = [0.0] * len(settings)
        for i in tqdm(range(max(len(w) for w in wins)), desc=name, disable=not progress, unit="window"):
            ref_logits = None
            for j, (s, w) in enumerate(zip(settings, wins)):
                if i >= len(w):
                    continue
                logits = s.logits(w[i])
                nll[j] += window_nll(logits, w[i])
                if j == 0:
                    ref_logits = logits[:-1]
                elif divs[j] is not None:
                    divs[j].add(ref_logits, logits[:-1])
        for s, w, total, div in zip(settings, wins, nll, divs):
            count = w.shape[0] * (seqlen - 1)
            s.row.ppl[name], s.row.tokens[name] = math.exp(total / count), count
            if div is not None:
                s.row.kl[name], s.row.top1[name] = div.kl, div.top1
        if reference:
            base = settings[0].row
            for s in settings[1:]:
                s.row.delta_pct[name] = 100.0 * (s.row.ppl[name] / base.ppl[name] - 1.0)


def _check(paths: Sequence[str | Path], kv_bits: Sequence[int], kv: KVSettings, device: Optional[str]) -> None:
    """Refuse bad settings and missing files before anything loads."""
    from quantkit.models.loading import ModelLoadError

    for b in kv_bits:
        EngineConfig(kv_bits=b, kv_scales=kv.scales, kv_rotation=kv.rotation)  # --kv-bits 3, …
    check_device(device)
    for p in paths:
        if not Path(p).exists():
            raise ModelLoadError(f"{p} does not exist: pass a model directory, a .gguf file or a quantkit checkpoint")
    if kv.scales == "static" and any(b != 16 for b in kv_bits):
        from quantkit.engine.kv_scales import stats_file_for

        for p in paths:
            stats_file_for(p, kv.stats)


def _texts(datasets: Sequence[str], data_dir: Optional[str]) -> dict[str, str]:
    texts = {}
    for d in datasets:
        text, source = load_text(d, "test", data_dir)
        texts[source.name] = text
    return texts


def evaluate_models(paths: Sequence[str | Path], datasets: Sequence[str] = ("ptb",), seqlen: int = 2048,
                    windows: Optional[int] = None, data_dir: Optional[str] = None, kv_bits: Sequence[int] = (16,),
                    kv: KVSettings = KVSettings(), device: Optional[str] = None, progress: bool = True,
                    reference: bool = False) -> Comparison:
    """`eval ppl`: perplexity of each model on each dataset under each KV setting, through the engine.
    A model evaluated under KV8/KV4 is evaluated at KV16 too, first: the reference of its other rows.
    `reference` runs transformers' own models instead (an independent check of the engine), which have no
    quantized KV cache."""
    if reference and any(b != 16 for b in kv_bits):
        raise UserError("--reference evaluates transformers' own model, which has no quantized KV cache: "
                        "drop --kv-bits, or drop --reference to measure the engine's KV quantization")
    _check(paths, kv_bits, kv, device)
    texts = _texts(datasets, data_dir)
    bits = list(dict.fromkeys([16, *kv_bits] if any(b != 16 for b in kv_bits) else kv_bits))
    rows: list[ModelRow] = []
    for p in paths:
        em = (load_reference_model if reference else load_engine_model)(p, device)
        settings = _settings(em, bits, kv, seqlen)
        _measure(settings, texts, seqlen, windows, progress, reference=len(settings) > 1)
        rows += [s.row for s in settings]
        for s in settings:
            log.info("%s %s: %s", s.row.name, s.row.kv, {k: round(v, 3) for k, v in s.row.ppl.items()})
        del em, settings
        gc.collect()
    quantized = len(bits) > 1
    return Comparison(rows, list(texts), seqlen, windows, "each model's KV16 row" if quantized else None)


def _measure_tasks(settings: list[_Setting], tasks: dict, num_fewshot: int, kv: KVSettings, device: Optional[str],
                   progress: bool) -> None:
    """Each row's accuracy on each task (one scorer, its own KV pool, per row, freed before the next), then
    every row's paired difference from settings[0], the reference row."""
    from quantkit.eval.accuracy import paired_difference, run_task, task_scorer

    for s in settings:
        config = EngineConfig(kv_bits=s.kv_bits, kv_scales=kv.scales, kv_stats=kv.stats, kv_rotation=kv.rotation,
                              device=device)
        scorer = task_scorer(s.em.model, s.em.path, config)
        for name, (spec, docs) in tasks.items():
            s.row.tasks[name] = run_task(scorer, s.em.tokenizer, spec, docs, num_fewshot, progress,
                                         desc=f"{s.row.name} {s.row.kv} {name}")
        del scorer
        gc.collect()
    for s in settings[1:]:
        for name in tasks:
            s.row.task_delta[name] = paired_difference(settings[0].row.tasks[name], s.row.tasks[name])


def compare(fp_model: str | Path, checkpoints: Sequence[str | Path], datasets: Optional[Sequence[str]] = None,
            seqlen: int = 2048, windows: Optional[int] = None, data_dir: Optional[str] = None,
            kv_bits: Sequence[int] = (16,), kv: KVSettings = KVSettings(), device: Optional[str] = None,
            output: Optional[str | Path] = None, progress: bool = True, tasks=None) -> Comparison:
    """Compare quantized checkpoints with their fp model on the engine: every row against the fp model
    at KV16. `datasets` are perplexity's (default: ptb, or none when `tasks` are given); `tasks` (an
    accuracy.TaskSettings) adds each row's task accuracy and its paired difference from the fp model's. With
    `output` (a .md path) also write the Markdown report and a PNG bar chart beside it (the chart only where
    matplotlib is installed: `report.write_report`)."""
    from quantkit.runtime.loader import model_config, read_quant_config

    if datasets is None:
        datasets = [] if tasks else ["ptb"]
    task_docs = {}
    if tasks:
        from quantkit.eval.accuracy import load_task_docs

        task_docs = load_task_docs(tasks)  # bad task settings and missing data: before any model loads
    elif not datasets:
        raise UserError("nothing to compare: give --dataset (perplexity) or --tasks (accuracy)")

    for c in checkpoints:  # "X is not a quantized checkpoint …", a broken config.json: before any evaluation
        read_quant_config(Path(c))
        model_config(Path(c))
    _check([fp_model, *checkpoints], kv_bits, kv, device)
    texts = _texts(datasets, data_dir)
    fp = load_engine_model(fp_model, device)
    # Without perplexity a setting's runner only names its pool (kv_label): one block is enough.
    pool = seqlen if texts else EngineConfig.block_size
    settings = _settings(fp, list(dict.fromkeys([16, *kv_bits])), kv, pool)
    for c in checkpoints:
        settings += _settings(load_engine_model(c, device), kv_bits, kv, pool)
    _measure(settings, texts, seqlen, windows, progress, reference=True)
    if task_docs:
        _measure_tasks(settings, task_docs, tasks.num_fewshot, kv, device, progress)
    result = Comparison([s.row for s in settings], list(texts), seqlen, windows, f"{fp.name} at KV16",
                        tasks=list(task_docs), task_limit=tasks.limit if tasks else None,
                        num_fewshot=tasks.num_fewshot if tasks else 0)
    del fp, settings
    gc.collect()
    if output is not None:
        result.written = [str(p) for p in write_report(result, Path(output)) if p is not None]
    return result

"""Perplexity of several models (and KV-cache settings) by one protocol, and the comparison against
the fp model: Δ % of perplexity and next-token top-1 agreement. Rendering lives in eval/report.py."""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from quantkit.config import KVQuantConfig, check_device
from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.eval.loading import EvalModel, load_for_eval, set_kv_cache
from quantkit.eval.perplexity import perplexity_of_windows
from quantkit.formats.kv_stats import FILE_NAME, KVStatsError, kv_stats_file
from quantkit.runtime.kv_cache import kv_cache_factory

log = logging.getLogger(__name__)


@dataclass
class ModelRow:
    """One model under one KV-cache setting."""

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
    top1_agreement: Optional[float] = None


@dataclass
class Comparison:
    """Rows in the order evaluated; with a reference, row 0 is it and the others carry deltas."""

    rows: list[ModelRow]
    datasets: list[str]
    seqlen: int
    windows: Optional[int]
    reference: Optional[str] = None
    written: list[str] = field(default_factory=list)  # report files (compare's `output`): .md, and .png if drawn

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Top1:
    """Collects argmax predictions per window, or scores them against a reference's."""

    def __init__(self, reference: Optional[list[torch.Tensor]] = None) -> None:
        self.reference, self.preds = reference, []
        self.same = self.total = 0

    def __call__(self, i: int, logits: torch.Tensor) -> None:
        pred = logits[:-1].argmax(-1).cpu()
        if self.reference is None:
            self.preds.append(pred)
        else:
            self.same += int((pred == self.reference[i]).sum())
            self.total += pred.numel()


def _evaluate(em: EvalModel, texts: dict[str, str], seqlen: int, windows: Optional[int], progress: bool,
              top1: Optional[_Top1], first_windows: Optional[torch.Tensor]) -> tuple[ModelRow, torch.Tensor]:
    row = ModelRow(em.name, em.path, em.method, em.bits, em.group_size, em.kv, em.size_bytes, em.size_note)
    factory = kv_cache_factory(em.model)
    win0 = None
    for j, (name, text) in enumerate(texts.items()):
        win = evaluation_windows(tokenize_text(em.tokenizer, text), seqlen, windows)
        hook = None
        if j == 0:
            win0 = win
            # Agreement compares predictions position by position: only meaningful on identical tokens.
            if top1 is not None and (first_windows is None or torch.equal(win, first_windows)):
                hook = top1
        nll, count = perplexity_of_windows(em.model, win, progress=progress, desc=f"{em.name} {em.kv} {name}",
                                           kv_cache=factory, on_logits=hook)
        row.ppl[name], row.tokens[name] = math.exp(nll), count
    return row, win0


def evaluate_models(paths: Sequence[str | Path], datasets: Sequence[str] = ("ptb",), seqlen: int = 2048,
                    windows: Optional[int] = None, data_dir: Optional[str] = None, kv_bits: Sequence[int] = (16,),
                    kv_scales: str = "online", kv_stats: Optional[str] = None, device: Optional[str] = None,
                    progress: bool = True, reference: bool = False) -> Comparison:
    """Perplexity of each model on each dataset, under each KV setting; with `reference`, the first
    model at kv 16 is the reference that later rows are compared with (Δ %, top-1 agreement)."""
    for b in kv_bits:
        KVQuantConfig(b, kv_scales)  # refuse --kv-bits 3 before loading anything
    check_device(device)
    from quantkit.models.loading import ModelLoadError

    for p in paths:
        if not Path(p).exists():
            raise ModelLoadError(f"{p} does not exist: pass a model directory, a .gguf file or a quantkit checkpoint")
    if kv_scales == "static" and any(b != 16 for b in kv_bits):
        for p in paths:
            src = Path(kv_stats or p)
            if not (src.is_file() and src.suffix == ".safetensors") and not (src.is_dir() and kv_stats_file(src)):
                raise KVStatsError(f"{p} has no {FILE_NAME} for --kv-scales static: run `quantkit kv-calibrate {p} "
                                   "--calib-dataset ptb` (with --output for fp models) or pass --kv-stats FILE")
    texts = {}
    for d in datasets:
        text, source = load_text(d, "test", data_dir)
        texts[source.name] = text
    rows: list[ModelRow] = []
    ref_top1: Optional[_Top1] = None
    ref_windows: Optional[torch.Tensor] = None
    # The reference is evaluated with an unquantized cache first, then under the other settings asked for.
    ref_kv = [16] + [b for b in kv_bits if b != 16]
    for i, p in enumerate(paths):
        em = load_for_eval(p, device=device)  # once per model; the KV settings only swap the cache
        for b in ref_kv if reference and i == 0 else kv_bits:
            set_kv_cache(em, b, kv_scales, kv_stats)
            is_ref = reference and i == 0 and b == 16
            top1 = _Top1() if is_ref else (_Top1(ref_top1.preds) if ref_top1 is not None else None)
            row, win0 = _evaluate(em, texts, seqlen, windows, progress, top1, None if is_ref else ref_windows)
            if is_ref:
                ref_top1, ref_windows = top1, win0
            elif top1 is not None and top1.total:
                row.top1_agreement = top1.same / top1.total
            rows.append(row)
            log.info("%s %s: %s", row.name, row.kv, {k: round(v, 3) for k, v in row.ppl.items()})
        del em
        gc.collect()
    if reference and rows:
        base = rows[0]
        for row in rows[1:]:
            row.delta_pct = {d: 100.0 * (row.ppl[d] / base.ppl[d] - 1.0) for d in row.ppl}
    return Comparison(rows, list(texts), seqlen, windows, rows[0].path if reference and rows else None)


def compare(fp_model: str | Path, checkpoints: Sequence[str | Path], datasets: Sequence[str] = ("ptb",),
            seqlen: int = 2048, windows: Optional[int] = None, data_dir: Optional[str] = None,
            kv_bits: Sequence[int] = (16,), kv_scales: str = "online", device: Optional[str] = None,
            output: Optional[str | Path] = None, progress: bool = True) -> Comparison:
    """Compare quantized checkpoints with their fp model; with `output` (a .md path) also write the
    Markdown report and a PNG bar chart of the perplexities beside it (the chart only where matplotlib
    is installed: `report.write_report`)."""
    from quantkit.runtime.loader import model_config, read_quant_config

    for c in checkpoints:  # "X is not a quantized checkpoint …", a broken config.json: before any evaluation
        read_quant_config(Path(c))
        model_config(Path(c))
    result = evaluate_models([fp_model, *checkpoints], datasets, seqlen, windows, data_dir, kv_bits, kv_scales,
                             None, device, progress, reference=True)
    if output is not None:
        from quantkit.eval.report import write_report

        result.written = [str(p) for p in write_report(result, Path(output)) if p is not None]
    return result

"""Error-feedback rounding (GPTQ's, Frantar et al. 2022) under fixed scales: AWQ's integer groups or FP8's e4m3.

The scales (and, on the integer grid, zeros) are fixed first — AWQ's after its scale and clip searches,
FP8's absmax / 448 — and plain rounding would take the nearest code for every weight on its own. Here
the codes are chosen column by column and the rounding error of each column is pushed onto the columns
not yet rounded, weighted by the inverse of the input Gram matrix H = Σ x xᵀ, so the layer's output
error ‖X(W − Ŵ)ᵀ‖² is what gets minimised rather than ‖W − Ŵ‖². Scales and zeros are not touched
("static groups"), so the checkpoint layout and every consumer are unchanged; only the codes differ.

The grid a column is rounded onto is an integer one, codes 0 … qmax with a zero point (W ≈ (q − z)·s),
or e4m3's (`E4M3_GRID`: W ≈ q·s with q an e4m3 value, saturated at ±448); the loop is the same.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from quantkit.packing import E4M3_MAX

# Fraction of the mean diagonal added to H: keeps the Cholesky factorisation stable when some
# input channels barely vary over the calibration set.
DAMP = 0.01
BLOCK = 128
E4M3_GRID = "e4m3"
# A grid: the largest code of an integer grid (codes 0 … qmax, zero point z), or E4M3_GRID.
Grid = Union[int, str]


def output_error(w: torch.Tensor, wq: torch.Tensor, hessian: torch.Tensor) -> float:
    """Σ_rows δᵀ H δ with δ = W − Ŵ: the output MSE (times tokens) over the calibration set."""
    d = (w - wq).float()
    return float(((d @ hessian) * d).sum())


def _inverse_cholesky(h: torch.Tensor, dead: torch.Tensor) -> Optional[torch.Tensor]:
    """Upper Cholesky factor of (H + λI)⁻¹, λ growing tenfold until the factorisation succeeds.

    At most three [in, in] matrices live at once besides H (down_proj of a 7B model: 0.5 GB each),
    which is what bounds the accelerator's peak memory during the rounding.
    """
    mean_diag = torch.diag(h).mean()
    for attempt in range(4):
        damped = h.clone()
        damped[dead, dead] = 1.0  # a channel that never fires: any code is as good as any other
        damped.diagonal().add_(DAMP * 10**attempt * mean_diag)
        chol, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) != 0:
            continue
        hinv = torch.cholesky_inverse(chol)
        del chol
        u, info = torch.linalg.cholesky_ex(hinv, upper=True)
        del hinv
        if int(info) == 0 and torch.isfinite(u).all():
            return u
    return None


def nearest_code(x: torch.Tensor, z: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The grid's nearest code (float32) to x = w / s, offset by the zero point z on an integer grid."""
    if grid == E4M3_GRID:
        return x.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.round(x).add_(z).clamp_(0, grid)


def _round_columns(wb: torch.Tensor, qb: torch.Tensor, errs: torch.Tensor, ub: torch.Tensor, sb: torch.Tensor,
                   zb: torch.Tensor, inv_diag: torch.Tensor, grid: Grid) -> None:
    """Round the block's columns one after another, each column's error fed to the later ones."""
    for j in range(wb.shape[1]):
        col, s, z = wb[:, j], sb[:, j], zb[:, j]
        q = nearest_code(col / s, z, grid)
        qb[:, j] = q
        err = (col - (q - z) * s).mul_(inv_diag[j])
        wb[:, j + 1 :].addr_(err, ub[j, j + 1 :], alpha=-1.0)
        errs[:, j] = err


class _GraphedColumns:
    """`_round_columns` for one block shape, captured once as a CUDA graph and replayed per block.

    The column loop is ~11 small kernels per column, so eager code is bound by launch overhead
    (a 7B model has ~23k columns per decoder block); the graph replays the very same kernels, in
    the same order, on the same inputs: the codes are those of the eager loop, bit for bit."""

    def __init__(self, rows: int, cols: int, device: torch.device, grid: Grid) -> None:
        f = dict(device=device, dtype=torch.float32)
        self.wb, self.qb, self.errs = (torch.zeros(rows, cols, **f) for _ in range(3))
        self.sb, self.zb = torch.ones(rows, cols, **f), torch.zeros(rows, cols, **f)
        self.ub, self.inv_diag = torch.eye(cols, **f), torch.ones(cols, **f)
        args = (self.wb, self.qb, self.errs, self.ub, self.sb, self.zb, self.inv_diag, grid)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            _round_columns(*args)  # warm-up outside the capture, as CUDA graphs require
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            _round_columns(*args)

    def __call__(self, wb, ub, sb, zb, inv_diag) -> tuple[torch.Tensor, torch.Tensor]:
        for dst, src in ((self.wb, wb), (self.ub, ub), (self.sb, sb), (self.zb, zb), (self.inv_diag, inv_diag)):
            dst.copy_(src)
        self.graph.replay()
        return self.qb, self.errs


_GRAPHS: dict[tuple, _GraphedColumns] = {}


def _graphed_columns(rows: int, cols: int, device: torch.device, grid: Grid) -> _GraphedColumns:
    key = (device, rows, cols, grid)
    if key not in _GRAPHS:
        if len(_GRAPHS) >= 8:  # a model has a few shapes (q/k/v, o, gate/up, down), each met every block
            _GRAPHS.clear()
        _GRAPHS[key] = _GraphedColumns(rows, cols, device, grid)
    return _GRAPHS[key]


@torch.no_grad()
def gptq_round(w: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, grid: Grid,
               group_size: int, graphs: Optional[bool] = None,
               updated: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Codes [out, in] (float32, on `grid`) for W [out, in] under fixed per-group `scales`/`zeros` [out, groups]
    (zeros 0 on the e4m3 grid).

    None when H cannot be factorised even with extra damping (the caller keeps nearest rounding).
    `graphs` (default: on CUDA) replays each block's column loop from a CUDA graph; same codes.
    `updated` ([out, in] float32), when given, receives the weights as they were rounded: W with the
    earlier columns' errors fed back, whose nearest codes are the codes returned.
    """
    w = w.float().clone()
    n = w.shape[1]
    dead = torch.diag(hessian) == 0
    w[:, dead] = 0.0
    u = _inverse_cholesky(hessian.float(), dead)
    if u is None:
        return None
    graphs = w.is_cuda if graphs is None else graphs
    scales, zeros = scales.float(), zeros.float()
    codes = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        ub = u[b0:b1, b0:b1]
        groups = torch.arange(b0, b1, device=w.device) // group_size
        sb, zb = scales[:, groups], zeros[:, groups]  # per column of the block: few launches per column
        inv_diag = 1.0 / torch.diag(ub)
        if graphs:
            qb, errs = _graphed_columns(w.shape[0], b1 - b0, w.device, grid)(w[:, b0:b1], ub, sb, zb, inv_diag)
        else:
            wb = w[:, b0:b1].clone()
            qb, errs = torch.empty_like(wb), torch.empty_like(wb)
            _round_columns(wb, qb, errs, ub, sb, zb, inv_diag, grid)
        codes[:, b0:b1] = qb
        if updated is not None:  # err = (col − dequantized) / U[j, j]
            updated[:, b0:b1] = (qb - zb) * sb + errs * torch.diag(ub)
        w[:, b1:] -= errs @ u[b0:b1, b1:]
    return codes


def gptq_codes(w: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bits: int, group_size: int, graphs: Optional[bool] = None,
               updated: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Integer codes [out, in] (int32) on the `bits`-bit grid: `gptq_round`'s, as integers."""
    codes = gptq_round(w, hessian, scales, zeros, 2**bits - 1, group_size, graphs, updated)
    return None if codes is None else codes.to(torch.int32)


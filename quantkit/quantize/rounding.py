"""Error-feedback rounding (GPTQ's, Frantar et al. 2022) on top of AWQ's scales, zeros and clip ranges.

AWQ fixes each group's scale and zero (after its scale and clip searches); plain rounding then takes
the nearest integer for every weight on its own. Here the integers are chosen column by column and
the rounding error of each column is pushed onto the columns not yet rounded, weighted by the
inverse of the input Gram matrix H = Σ x xᵀ, so the layer's output error ‖X(W − Ŵ)ᵀ‖² is what gets
minimised rather than ‖W − Ŵ‖². Scales and zeros are not touched ("static groups"), so the
checkpoint layout and every consumer are unchanged; only the integer codes differ.
"""

from __future__ import annotations

import torch

# Fraction of the mean diagonal added to H: keeps the Cholesky factorisation stable when some
# input channels barely vary over the calibration set.
DAMP = 0.01
BLOCK = 128


def output_error(w: torch.Tensor, wq: torch.Tensor, hessian: torch.Tensor) -> float:
    """Σ_rows δᵀ H δ with δ = W − Ŵ: the output MSE (times tokens) over the calibration set."""
    d = (w - wq).float()
    return float(((d @ hessian) * d).sum())


@torch.no_grad()
def gptq_codes(w: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bits: int, group_size: int) -> torch.Tensor:
    """Integer codes [out, in] (int32) for W [out, in] under fixed per-group `scales`/`zeros` [out, groups]."""
    w = w.float().clone()
    n = w.shape[1]
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0  # a channel that never fires: any code is as good as any other
    w[:, dead] = 0.0
    h += DAMP * torch.diag(h).mean() * torch.eye(n, device=h.device, dtype=h.dtype)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(hinv, upper=True)
    qmax = 2**bits - 1
    scales, zeros = scales.float(), zeros.float()
    codes = torch.empty(w.shape, dtype=torch.int32, device=w.device)
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        wb = w[:, b0:b1].clone()
        errs = torch.empty_like(wb)
        ub = u[b0:b1, b0:b1]
        for j in range(b1 - b0):
            g = (b0 + j) // group_size
            s, z = scales[:, g], zeros[:, g]
            col = wb[:, j]
            q = torch.round(col / s).add_(z).clamp_(0, qmax)
            codes[:, b0 + j] = q.to(torch.int32)
            err = (col - (q - z) * s) / ub[j, j]
            wb[:, j:] -= err.unsqueeze(1) * ub[j, j:].unsqueeze(0)
            errs[:, j] = err
        w[:, b1:] -= errs @ u[b0:b1, b1:]
    return codes

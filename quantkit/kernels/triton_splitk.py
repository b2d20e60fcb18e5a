"""Split-K in one launch: each program writes its partial tile, the last one to finish a tile sums.

Programs that share an output tile but own different slices of K store fp32 partials to a workspace
[SPLIT_K, M, N] and bump a per-tile counter; the program that sees the count reach SPLIT_K − 1 reads
the partials back in slice order (so the sum is deterministic), adds the bias, writes the output and
resets the counter to zero for the next launch. No memset and no second kernel: one launch per
linear, which matters when a decode step is replayed from a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int, make: bool = True) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least `tiles` counters, kept per device (the kernels leave it zeroed);
    with `make` False, None rather than a new buffer when none that large exists yet.

    Call it once outside CUDA-graph capture (a warm-up call does) so the buffer is not graph memory.
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if not make:
            return None
        buf = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def clamp_split(split_k: int, m: int, n: int) -> int:
    """split_k, lowered if need be so that workspace offsets (int32 in the kernels) stay below 2^31."""
    return max(1, min(split_k, (2**31 - 1) // max(m * n, 1)))


def workspace(split_k: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """fp32 partials [split_k, m, n]; a 1-element dummy when split_k is 1."""
    if split_k == 1:
        return torch.empty(1, dtype=torch.float32, device=device)
    return torch.empty(split_k, m, n, dtype=torch.float32, device=device)


def launch_buffers(x: torch.Tensor, kw, out: torch.Tensor | None, split_k: int, blocks: int, tiles: int):
    """What a kernel launch over `tiles` output tiles needs besides the weights: x with unit column
    stride, the output [M, N] (allocated unless given), split-K bounded by the K steps of 4·`blocks`
    words and by int32 offsets, its workspace, and the tile counters."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], kw.out_features
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split_k = clamp_split(max(1, min(split_k, triton.cdiv(kw.qweight.shape[1], 4 * blocks))), m, n)
    return x, out, split_k, workspace(split_k, m, n, x.device), counters(x.device, tiles)


@triton.jit
def _write(acc, om, on, N, mask, out_ptr, stride_om, bias_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + on, mask=on < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + om * stride_om + on, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(acc, om, on, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, tile_id, pid_k,
            SPLIT_K, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write fp32 values `acc` at output rows `om`, columns `on` (broadcast to acc's shape)."""
    mask = (om < M) & (on < N)
    if not SPLIT:
        _write(acc, om, on, N, mask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
    else:
        ws_off = om * N + on
        slice_size = M * N  # int32: the launcher keeps split_k·M·N below 2^31
        tl.store(ws_ptr + pid_k * slice_size + ws_off, acc, mask=mask)
        # Every thread's partial is stored before the one release below publishes the tile.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + s * slice_size + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
            _write(total, om, on, N, mask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_tile(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, tile_id, pid_k,
               SPLIT_K, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write the fp32 tile `acc` [BM, BN] to out, through the split-K workspace when SPLIT (K > 1)."""
    _finish(acc, offs_m[:, None], offs_n[None, :], M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr,
            tile_id, pid_k, SPLIT_K, SPLIT, HAS_BIAS)


@triton.jit
def store_points(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, tile_id, pid_k,
                 SPLIT_K, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write fp32 values `acc` [P] to the output elements (offs_m[i], offs_n[i]), as store_tile does."""
    _finish(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, tile_id, pid_k,
            SPLIT_K, SPLIT, HAS_BIAS)

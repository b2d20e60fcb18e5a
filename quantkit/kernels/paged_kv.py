"""The paged KV cache of one decoder layer, and the torch reference of what reads and writes it.

A layer's cache is a pool of fixed-size blocks; a sequence owns a list of them (its block table), and
its token i lives at slot = block_table[i // block_size] * block_size + i % block_size. K and V are
stored as the model's dtype (bits 16) or as integer codes (bits 8 or 4) with one fp16 scale and one
uint8 zero per token per head beside them, asymmetric as lmdeploy's quant_policy 8/4: a code
q = clamp(round(x / s) + z, 0, 2^b − 1) reads back as (q − z) · s. Int4 codes are packed two per byte
along head_dim, the low nibble holding the even channel. Codes are [block, head, token, channel] and
scales and zeros [block, head, token], so that the block_size tokens of one head that a kernel's tile
reads lie side by side: a KV4 block of a 128-channel head is one 1 KB piece, not 16 pieces of 64 bytes
a head-count of rows apart. `by_slot` gives the token-major views [block, token, head, ...] that the torch code indexes by slot.

The scale and zero of a token are its own row's range (online), or, when the cache holds static
per-head scales (`PagedKV.static`, from calibration statistics), that head's fixed scale and zero:
the write then stores them in the same per-token slots and clips values outside the calibrated range,
so every reader of the cache works unchanged. A pool with a `rotation` (KV4 online, by default) holds
keys centred and Hadamard-rotated (kernels/kv_rotation.py): Attention transforms q and k before the
write, and these functions see only the transformed tensors.

`write_kv`, `paged_decode_attention` and `paged_prefill_attention` run the Triton kernels of
kernels/triton_paged.py and triton_prefill.py where the pool's `kernels` say so (KernelSettings.triton: by
default an NVIDIA GPU of compute capability 8.0 or later; path "triton" with TRITON_INTERPRET=1 runs
them on the CPU through Triton's interpreter) and this module's torch code elsewhere: there, prefill attention
gathers each sequence's context and calls SDPA (with a cached prefix, a bottom-right causal mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from quantkit.config import UserError, check_kv_bits
from quantkit.kernels.kv_rotation import KVRotation, pool_rotation
from quantkit.kernels.settings import AUTO, KernelSettings

# (query_start, context_lens) of a prefill step as host lists: what its per-sequence loops read
HostLens = tuple[list[int], list[int]]

QMAX = {8: 255, 4: 15}  # the largest code of each integer width
# The smallest normal fp16 number: smaller scales would lose relative precision as subnormals.
MIN_SCALE = 2.0**-14


@dataclass
class PagedKV:
    """One decoder layer's cache; see the module docstring for the layout."""

    k: Tensor  # bits 16: [num_blocks, kv_heads, block_size, head_dim] model dtype; 8: uint8 same; 4: uint8 head_dim/2
    v: Tensor
    k_scale: Optional[Tensor]  # bits 8/4: fp16 [num_blocks, kv_heads, block_size]; None for 16
    k_zero: Optional[Tensor]  # bits 8/4: uint8 [num_blocks, kv_heads, block_size]
    v_scale: Optional[Tensor]
    v_zero: Optional[Tensor]
    bits: int
    # Static per-head codes (bits 8/4): (k_scale fp16 [kv_heads], k_zero uint8, v_scale, v_zero) that every
    # write uses instead of the token's own range; None: online.
    static: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None
    # Keys are stored centred and rotated by a block-Hadamard matrix (kernels/kv_rotation.py), which Attention
    # applies to q and k before the write; the kernels read and write the pool unchanged. None: as they come.
    rotation: Optional[KVRotation] = None
    kernels: KernelSettings = AUTO  # whether its readers and writers run the Triton kernels, and which decode

    @staticmethod
    def allocate(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, bits: int,
                 dtype: torch.dtype, device: torch.device | str,
                 static: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None,
                 rotation: Optional[str] = None, kernels: KernelSettings = AUTO) -> "PagedKV":
        """A zeroed pool (zeros, so that a slot never written holds finite numbers). `static`: the
        per-head (k_scale, k_zero, v_scale, v_zero) of `static_scales` (bits 16 has none to use). `rotation`:
        "hadamard", "none", or "auto"/None (hadamard for bits 4 with online scales). `kernels`: see the field."""
        check_bits(bits, head_dim)
        rotate = pool_rotation(rotation, bits, static is not None, head_dim, dtype, device)
        if static is not None:
            if any(t.shape != (kv_heads,) for t in static):
                raise UserError(f"static KV scales hold {[tuple(t.shape) for t in static]} values, "
                                f"not one per KV head ({kv_heads}): statistics of another model?")
            static = tuple(t.to(device) for t in static)
        code_dim = head_dim // 2 if bits == 4 else head_dim
        code_dtype = dtype if bits == 16 else torch.uint8
        shape = (num_blocks, kv_heads, block_size)

        def codes() -> Tensor:
            return torch.zeros(*shape, code_dim, dtype=code_dtype, device=device)

        if bits == 16:
            return PagedKV(codes(), codes(), None, None, None, None, 16, rotation=rotate, kernels=kernels)
        per_head = (num_blocks, kv_heads, block_size)
        scale = lambda: torch.zeros(per_head, dtype=torch.float16, device=device)  # noqa: E731
        zero = lambda: torch.zeros(per_head, dtype=torch.uint8, device=device)  # noqa: E731
        return PagedKV(codes(), codes(), scale(), zero(), scale(), zero(), bits, static, rotate, kernels)

    @staticmethod
    def bytes_per_token(kv_heads: int, head_dim: int, bits: int, dtype: torch.dtype) -> int:
        """Bytes one token takes in one layer: K and V codes, plus an fp16 scale and a uint8 zero each."""
        check_bits(bits, head_dim)
        if bits == 16:
            return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * kv_heads * (head_dim * bits // 8 + 3)

    def by_slot(self, which: str) -> tuple[Tensor, Tensor, Tensor]:
        """The codes [num_blocks, block_size, kv_heads, code_dim], scale and zero [num_blocks, block_size,
        kv_heads] of K or V ("k" / "v") as views indexed by block and offset (scale and zero None at bits 16)."""
        codes = getattr(self, which).transpose(1, 2)
        if self.bits == 16:
            return codes, None, None
        return codes, getattr(self, which + "_scale").transpose(1, 2), getattr(self, which + "_zero").transpose(1, 2)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3] * 2 if self.bits == 4 else self.k.shape[3]


def check_bits(bits: int, head_dim: int) -> None:
    """Refuse a width the pool cannot store, and int4 codes of an odd head_dim (two channels per byte)."""
    check_kv_bits(bits)
    if bits == 4 and head_dim % 2:
        raise UserError(f"kv_bits 4 packs two channels per byte, but head_dim is {head_dim} (odd): use kv_bits 8.")


# ---- quantization: quantkit's only KV codec (the Triton write kernel does the same arithmetic)

def range_scale_zero(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Scale (fp16 values in float32) and integer zero (float32) of codes spanning [min(lo, 0), max(hi, 0)].

    The range always includes 0, so the zero is an integer code; the scale is rounded *up* to fp16
    (grown by 2^-10 before rounding to nearest) so that the stored scale still spans the range."""
    qmax = QMAX[bits]
    lo, hi = lo.float().clamp(max=0), hi.float().clamp(min=0)
    # Divided by a tensor, not a Python number: on CUDA torch turns division by a host scalar into a
    # multiplication by its reciprocal, one ulp off IEEE division at times, which flips the fp16
    # rounding of the scale for about one row in 10^4 (the Triton write divides exactly).
    scale = torch.div(hi - lo, torch.full_like(hi, qmax)).clamp_min(MIN_SCALE)
    scale = (scale * (1 + 2.0**-10)).half().float()
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero


def encode(x: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """uint8 codes of x [..., D] under scale and zero [...] (float32); values out of range are clipped."""
    return (torch.round(x.float() / scale[..., None]) + zero[..., None]).clamp_(0, QMAX[bits]).to(torch.uint8)


def quantize_per_token(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes of x [..., D] with one scale and zero per row: (q uint8 [..., D], scale fp16 [...], zero uint8 [...])."""
    xf = x.float()
    scale, zero = range_scale_zero(xf.amin(-1), xf.amax(-1), bits)
    return encode(xf, scale, zero, bits), scale.half(), zero.to(torch.uint8)


def static_scales(k_min: Tensor, k_max: Tensor, v_min: Tensor, v_max: Tensor,
                  bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One layer's static per-head codes from calibrated ranges [kv_heads, head_dim] (or [kv_heads]):
    (k_scale fp16, k_zero uint8, v_scale fp16, v_zero uint8), each [kv_heads], for `PagedKV.static`."""
    out = []
    for lo, hi in ((k_min, k_max), (v_min, v_max)):
        if lo.dim() == 2:
            lo, hi = lo.amin(-1), hi.amax(-1)
        scale, zero = range_scale_zero(lo, hi, bits)
        out += [scale.half(), zero.to(torch.uint8)]
    return tuple(out)


def quantize_static(x: Tensor, scale: Tensor, zero: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes of x [T, kv_heads, D] under per-head scale (fp16) and zero (uint8) [kv_heads], in the shapes
    of `quantize_per_token`: the per-head values repeated for every token."""
    s, z = scale.float().expand(x.shape[:-1]), zero.float().expand(x.shape[:-1])
    return encode(x, s, z, bits), s.half(), z.to(torch.uint8)


def pack_int4(q: Tensor) -> Tensor:
    """Two 4-bit codes per byte along the last dim: low nibble = even index."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: Tensor) -> Tensor:
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """(q − z) · s in `dtype` for codes [..., D or D/2] and scale, zero [...]."""
    q = unpack_int4(codes) if bits == 4 else codes
    return ((q.float() - zero.float()[..., None]) * scale.float()[..., None]).to(dtype)


# ---- write and gather

def write_kv(cache: PagedKV, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at slots slot_mapping [T] (int64; entries < 0 are skipped), coded
    with the cache's static per-head scales when it has them, else with each token's own range."""
    if cache.kernels.triton(k.device):
        from quantkit.kernels import triton_paged

        return triton_paged.write_kv(cache, k, v, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    static = cache.static or (None,) * 4
    blocks, offsets = slots // cache.block_size, slots % cache.block_size
    for x, which, fixed in ((k, "k", static[:2]), (v, "v", static[2:])):
        x = x[valid]
        codes, scale, zero = cache.by_slot(which)
        if cache.bits == 16:
            codes[blocks, offsets] = x.to(codes.dtype)
            continue
        if cache.static is None:
            q, s, z = quantize_per_token(x, cache.bits)
        else:
            q, s, z = quantize_static(x, *fixed, cache.bits)
        codes[blocks, offsets] = pack_int4(q) if cache.bits == 4 else q
        scale[blocks, offsets] = s
        zero[blocks, offsets] = z


def _read(cache: PagedKV, which: str, blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """Blocks [...] of K or V dequantized: [..., block_size, kv_heads, head_dim]."""
    codes, scale, zero = (t if t is None else t[blocks] for t in cache.by_slot(which))
    if cache.bits == 16:
        return codes.to(dtype)
    return dequantize(codes, scale, zero, cache.bits, dtype)


def gather_kv(cache: PagedKV, block_table: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One sequence's first `length` tokens, dequantized to `dtype`: k, v [length, kv_heads, head_dim]."""
    blocks = block_table[: math.ceil(length / cache.block_size)].long()
    k, v = (_read(cache, w, blocks, dtype).flatten(0, 1)[:length] for w in ("k", "v"))
    return k, v


# ---- attention

def paged_decode_attention(q: Tensor, cache: PagedKV, block_tables: Tensor, context_lens: Tensor,
                           sm_scale: float) -> Tensor:
    """Attention of one query token per sequence, q [B, heads, head_dim], over its context_lens[b] cached
    tokens (its own K/V already written); block_tables [B, max_blocks] int32 (entries past the context
    are never read). GQA: query head h reads kv head h // (heads // kv_heads). Returns [B, heads, head_dim]."""
    if cache.kernels.triton(q.device):
        from quantkit.kernels import triton_paged

        return triton_paged.paged_decode_attention(q, cache, block_tables, context_lens, sm_scale)
    b, heads, d = q.shape
    group = heads // cache.kv_heads
    max_len = int(context_lens.max())
    blocks = block_tables[:, : math.ceil(max_len / cache.block_size)].long().clamp(0, cache.num_blocks - 1)
    # [B, L, kv_heads, D] with L the longest context; positions past a sequence's own length are masked
    k, v = (_read(cache, w, blocks, q.dtype).flatten(1, 2)[:, :max_len].float() for w in ("k", "v"))
    qg = q.float().view(b, cache.kv_heads, group, d)
    past = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None].to(q.device)
    v = v.masked_fill(past[:, :, None, None], 0.0)  # slots never written may hold anything, NaN included
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * sm_scale
    scores.masked_fill_(past[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v)
    return out.reshape(b, heads, d).to(q.dtype)


def paged_prefill_attention(q: Tensor, cache: PagedKV, block_tables: Tensor, context_lens: Tensor,
                            query_start: Tensor, sm_scale: float, host: Optional[HostLens] = None) -> Tensor:
    """Causal attention of several sequences' new tokens, q [T, heads, head_dim] packed by query_start
    [B+1] (cumulative): sequence b's queries are the last query_start[b+1] − query_start[b] of its
    context_lens[b] cached tokens (a cached prefix, then the new ones). Gather + SDPA per sequence.
    `host`: (query_start, context_lens) as host lists when the caller has them (every layer of a step
    passes the same); None reads them from the device, a sync that drains the launch queue."""
    if cache.kernels.triton(q.device):
        from quantkit.kernels import triton_prefill

        return triton_prefill.paged_prefill_attention(q, cache, block_tables, context_lens, query_start, sm_scale,
                                                      host=host)
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], cache.kv_heads
    starts, lens = host if host is not None else (query_start.tolist(), context_lens.tolist())
    for b, length in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k, v = gather_kv(cache, block_tables[b], length, q.dtype)
        if heads != kv_heads:
            k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        qb, k, v = q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, n, D]
        n = e - s
        if n == length:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=sm_scale)
        else:  # query i sits at position length − n + i: bottom-right aligned causal mask
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=sm_scale)
        out[s:e] = o.transpose(0, 1)
    return out

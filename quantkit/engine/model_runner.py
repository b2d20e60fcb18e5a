"""ModelRunner: the KV pool, one step's tensors, the forward, and CUDA graphs for decode steps.

The pool is sized once, at start: on CUDA it takes `cache_max_entry_count` of the memory still free
after the weights and a warm-up forward of the largest step (lmdeploy's rule); on the CPU it holds
`num_kv_tokens` tokens. A step whose sequences each bring one token (a pure decode) replays a CUDA graph
captured for the next batch-size bucket up; the padding rows write nowhere (slot -1). A step with
prompt tokens replays piecewise graphs around its eager attention (engine/piecewise.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from quantkit.config import ConfigError, UserError
from quantkit.engine import piecewise
from quantkit.engine.attention import AttnMetadata
from quantkit.engine.kv_scales import pool_static_scales
from quantkit.engine.layers import use_kernels
from quantkit.engine.multimodal import step_embeds
from quantkit.engine.sampler import pinned_copy
from quantkit.kernels.capture import graph_warmup
from quantkit.kernels.paged_kv import PagedKV

log = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Token counts around which the quantized linears change kernel configuration (the M bounds of
# kernels/dispatch_table.py) or Triton its specialization (an integer argument divisible by 16 or not): the warm-up
# runs a forward at each bound and one below it, so no request meets a kernel compiled on first sight.
WARMUP_BOUNDS = (8, 16, 32, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192)
CPU_KV_TOKENS = 8192


@dataclass
class StepInputs:
    """One step's flat inputs; `sample_rows` are the rows of the tokens whose logits are wanted."""

    input_ids: torch.Tensor   # [T] int64
    positions: torch.Tensor   # [T] int64
    meta: AttnMetadata
    sample_rows: torch.Tensor  # [N] int64, row in the flat batch of each sampled sequence's last token
    sampled: list             # the sequences that get a token this step, in `sample_rows` order
    # (rows, embeddings) replacing the token embeddings of image placeholders (multimodal.step_embeds)
    input_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 [B, longest] tensor, zero-padded (built through numpy: a step of 256
    decodes has ~10⁴ entries, and torch.tensor parses nested lists ~3× slower)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    width = int(lens.max())
    out = np.zeros((len(tables), width), np.int32)
    out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(tables), np.int32,
                                                                 int(lens.sum()))
    return torch.from_numpy(out)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: the buckets below max_num_seqs and the first one that
    holds it (a decode batch larger than the last bucket runs eagerly)."""
    below = [b for b in GRAPH_BUCKETS if b < max_num_seqs]
    return below + [b for b in GRAPH_BUCKETS if b >= max_num_seqs][:1]


class ModelRunner:
    """Owns the model's KV pool and runs it on scheduled batches."""

    def __init__(self, model: torch.nn.Module, config, phases: Optional[Callable[[str], Any]] = None) -> None:
        """`phases(name)`: a context manager timing each start-up phase (the engine's StartPhases)."""
        phases = phases or (lambda name: contextlib.nullcontext())
        self.model, self.config = model, config
        use_kernels(model, config.kernels)
        self.device, self.dtype = model.device, model.dtype
        self.block_size = config.block_size
        self.num_layers, self.kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, model.max_positions)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        with phases("KV pool, prefill kernels"):
            self.num_blocks = self._allocate_pool()
            self._warmup_pool()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.piecewise: Optional[piecewise.PiecewiseGraphs] = None
        self.use_graphs = bool(config.cuda_graphs) and self.device.type == "cuda"
        if self.use_graphs:
            with phases("decode graphs"):
                self.capture_graphs()
            with phases("prefill graphs"):
                self.capture_piecewise()

    @staticmethod
    def _resolve_max_model_len(requested: Optional[int], max_positions: int) -> int:
        """The context one sequence may hold: `requested`, else the model's; past the model's positions
        (its rotary table, max_position_embeddings) a request is refused, not shortened unseen."""
        if requested is not None and requested > max_positions:
            raise ConfigError(f"--max-model-len {requested} is more than this model supports ({max_positions} "
                              f"tokens, its max_position_embeddings): pass {max_positions} or less, or leave it "
                              "unset.")
        return requested or max_positions

    # --- the pool ---------------------------------------------------------------------------------

    def bytes_per_token(self) -> int:
        """KV bytes one token takes in every layer together."""
        per_layer = PagedKV.bytes_per_token(self.kv_heads, self.head_dim, self.config.kv_bits, self.dtype)
        return per_layer * self.num_layers

    def _allocate(self, num_blocks: int) -> None:
        static = pool_static_scales(self.config, self.num_layers, self.kv_heads, self.head_dim)
        caches = [PagedKV.allocate(num_blocks, self.block_size, self.kv_heads, self.head_dim, self.config.kv_bits,
                                   self.dtype, self.device, static=static[i] if static else None,
                                   rotation=self.config.kv_rotation, kernels=self.config.kernels)
                  for i in range(self.num_layers)]
        self.model.set_kv_caches(caches)
        self.kv_caches = caches

    def _allocate_pool(self) -> int:
        if self.device.type == "cuda":
            num_tokens = self._cuda_pool_tokens()
        else:
            num_tokens = self.config.num_kv_tokens or CPU_KV_TOKENS
        num_blocks = num_tokens // self.block_size
        if num_blocks < 1:
            raise UserError(f"the KV pool holds only {num_tokens} tokens: raise --cache-max-entry-count "
                            "(or num_kv_tokens on the CPU), or use --kv-bits 8 to fit more tokens")
        self._allocate(num_blocks)
        log.info("KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB, kv_bits %d)", num_blocks, self.block_size,
                 num_blocks * self.block_size, num_blocks * self.block_size * self.bytes_per_token() / 2**30,
                 self.config.kv_bits)
        return num_blocks

    def _cuda_pool_tokens(self) -> int:
        """cache_max_entry_count × the memory free after the weights and a warm-up forward of the largest
        step (its activations stay reserved: the pool must leave room for them)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        torch.cuda.synchronize(self.device)
        if self.config.num_kv_tokens:
            return self.config.num_kv_tokens
        free, _ = torch.cuda.mem_get_info(self.device)
        reusable = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        available = max(free + reusable - activations, 0)
        return int(self.config.cache_max_entry_count * available) // self.bytes_per_token()

    @torch.no_grad()
    def _warmup(self) -> None:
        """One forward of a step as large as the scheduler may make (attention over its own tokens: no
        pool exists yet) and the logits of as many sequences as a step samples, so their activations
        count in the peak; then smaller forwards at the WARMUP_BOUNDS token counts, which compile the
        kernels every later step size needs (a first sight costs a request ≈ 1 s of compilation)."""
        largest = min(self.config.max_num_batched_tokens, self.max_model_len)
        counts = sorted({c for b in WARMUP_BOUNDS for c in (b - 1, b) if 1 < c < largest}, reverse=True)
        self.model.set_kv_caches([None] * self.num_layers)
        for tokens in [largest] + counts:
            hidden = self._forward_dummy_prompt(tokens)
            self.model.compute_logits(hidden[-min(self.config.max_num_seqs, tokens):])

    def _forward_dummy_prompt(self, tokens: int) -> torch.Tensor:
        """The forward of one sequence of `tokens` zero ids prefilled from position 0 into slots 0…tokens − 1
        (the first blocks of the pool, when there is one)."""
        positions = torch.arange(tokens, device=self.device)
        meta = AttnMetadata(
            slot_mapping=positions.clone(), block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            query_start=torch.tensor([0, tokens], dtype=torch.int32, device=self.device), is_decode=False,
            host_lens=([0, tokens], [tokens]))
        return self.model(torch.zeros(tokens, dtype=torch.long, device=self.device), positions, meta)

    @torch.no_grad()
    def _warmup_pool(self) -> None:
        """A prefill of one block's worth of tokens through the pool (block 0, which no sequence holds yet and
        each one that takes it overwrites before reading), so the KV write and the prefill attention kernels
        compile before the first request rather than in its time to first token. The block is zeroed again
        after it, as the whole pool starts."""
        self._forward_dummy_prompt(min(self.block_size, self.max_model_len))
        for cache in self.kv_caches:
            for t in (cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero):
                if t is not None:
                    t[0].zero_()

    # --- one step ---------------------------------------------------------------------------------

    def prepare(self, batch, previous: Optional[torch.Tensor] = None) -> StepInputs:
        """Flat token ids, positions and attention metadata for the scheduled (sequence, new tokens) pairs.
        `previous`: the sampled token ids [N] (on the device) of the step still in flight, whose row
        `seq.pending_row` is the input of each decode whose last token is PENDING."""
        ids, positions, slots, tables, context_lens, query_start = [], [], [], [], [], [0]
        sample_rows, sampled = [], []
        pending_rows, pending_src = [], []
        bs = self.block_size
        for seq, n in batch:
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # a decode: most of a large step's sequences
                if seq.has_pending:
                    pending_rows.append(len(ids))
                    pending_src.append(seq.pending_row)
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                if seq.has_pending:  # the scheduler admits no prompt whose last token is still on the device
                    raise RuntimeError(f"sequence {seq.request_id} was scheduled {n} tokens while its last token "
                                       "is still being sampled")
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table)
            context_lens.append(end)
            query_start.append(query_start[-1] + n)
            if end == len(seq.token_ids):  # its whole prompt (or its last token) is in the cache: sample
                sample_rows.append(query_start[-1] - 1)
                sampled.append(seq)
        padded = _pad_tables(tables)
        # Two host-to-device copies per step, from pinned memory so that neither waits for the step in flight:
        # the 1-D int64 fields travel together and are cut apart on the device.
        t, b, n, p = len(ids), len(tables), len(sample_rows), len(pending_rows)
        if p and previous is None:
            raise RuntimeError("a step reads tokens still being sampled, but no step is in flight")
        flat = pinned_copy(torch.tensor(ids + positions + slots + context_lens + query_start + sample_rows
                                            + pending_rows + pending_src, dtype=torch.long), self.device)
        ids_d, pos_d, slots_d, ctx_d, qs_d, rows_d, prow_d, psrc_d = flat.split([t, t, t, b, b + 1, n, p, p])
        if p:
            ids_d[prow_d] = previous[psrc_d]
        meta = AttnMetadata(
            slot_mapping=slots_d,
            block_tables=pinned_copy(padded, self.device),
            context_lens=ctx_d.to(torch.int32),
            query_start=qs_d.to(torch.int32),
            is_decode=all(n == 1 for _, n in batch),
            host_lens=(query_start, context_lens),
        )
        if not meta.is_decode:
            # The leading one-token sequences (decodes: the scheduler puts them first) attend in one batched
            # kernel; the prefill chunks after them get their own metadata, renumbered from 0.
            nd = next((i for i, (_, n) in enumerate(batch) if n != 1), len(tables))
            if nd:
                meta.num_decode = nd
                meta.prefill = (meta.block_tables[nd:], meta.context_lens[nd:], meta.query_start[nd:] - nd,
                                ([s - nd for s in query_start[nd:]], context_lens[nd:]))
        return StepInputs(ids_d, pos_d, meta, rows_d, sampled, step_embeds(batch, self.device))

    def _forward(self, step: StepInputs) -> torch.Tensor:
        pieces = self.piecewise
        if pieces is not None and step.input_embeds is None and pieces.bucket(step.input_ids.shape[0]) is not None:
            return pieces.forward(step.input_ids, step.positions, step.meta)
        return self.model(step.input_ids, step.positions, step.meta, input_embeds=step.input_embeds)

    @torch.no_grad()
    def run(self, batch, previous: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], list]:
        """Forward one scheduled batch: (float32 logits [N, vocab] of the sequences that get a token this
        step, those sequences). Logits are None when no sequence samples (only partial prompt chunks).
        `previous`: the step in flight's sampled tokens on the device (see `prepare`)."""
        step = self.prepare(batch, previous)
        graphable = step.meta.is_decode and len(step.sampled) == len(batch) and step.input_embeds is None
        bucket = self._bucket(len(step.sampled)) if graphable else None
        if bucket is not None:
            logits = self._replay(step, bucket)
        else:
            hidden = self._forward(step)
            logits = self.model.compute_logits(hidden[step.sample_rows]) if step.sampled else None
        return logits, step.sampled

    @torch.no_grad()
    def prompt_logits(self, batch, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward one batch of prefill chunks, as `run`, and return the float32 logits [T, vocab] of every
        new token in batch order, not only of the sampled ones (prompt log-probabilities, perplexity); with
        `rows` (int64 indices into those T tokens) the logits of those rows only."""
        step = self.prepare(batch)
        hidden = self._forward(step)
        return self.model.compute_logits(hidden if rows is None else hidden[rows.to(hidden.device)])

    # --- CUDA graphs for decode steps ---------------------------------------------------------------

    def _bucket(self, batch_size: int) -> Optional[int]:
        if not self.graphs:
            return None
        return next((b for b in sorted(self.graphs) if b >= batch_size), None)

    @torch.no_grad()
    def capture_graphs(self, capture: Optional[Callable] = None) -> None:
        """One graph per bucket, the largest first so the smaller ones reuse its memory pool. The graphs
        read the static tensors below (the captured forward is passed the metadata made of them); `_replay`
        copies each step's values into them. `capture(forward, meta)` → (graph, output) makes one graph
        (default: a CUDA graph; the tests pass an eager stand-in)."""
        capture = capture or (lambda forward, meta: self._cuda_graph(forward, "_graph_pool"))
        buckets = graph_buckets(self.config.max_num_seqs)
        n, dev = buckets[-1], self.device
        self.g_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.g_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.g_context = torch.ones(n, dtype=torch.int32, device=dev)
        self.g_query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.g_logits: dict[int, torch.Tensor] = {}
        self._graph_pool = None
        try:
            for b in reversed(buckets):
                meta = AttnMetadata(self.g_slots[:b], self.g_tables[:b], self.g_context[:b],
                                    self.g_query_start[:b + 1], is_decode=True)

                def forward(b: int = b, meta: AttnMetadata = meta) -> torch.Tensor:
                    return self.model.compute_logits(self.model(self.g_ids[:b], self.g_positions[:b], meta))

                self.graphs[b], self.g_logits[b] = capture(forward, meta)
        except RuntimeError as exc:  # a kernel that cannot be captured: decode eagerly, still correct
            log.warning("CUDA-graph capture failed, decoding eagerly: %s", str(exc).splitlines()[0])
            self.graphs.clear()
            self.g_logits = {}

    @torch.no_grad()
    def capture_piecewise(self, capture: Optional[piecewise.Capture] = None) -> None:
        """Piecewise graphs for steps with prompt tokens, up to config.graph_max_tokens tokens (and no
        more than a step may hold). `capture(piece)` → replay callable (default: a CUDA graph; the tests
        pass an eager stand-in)."""
        limit = min(self.config.graph_max_tokens, self.config.max_num_batched_tokens)
        if limit <= 0 or not piecewise.supported(self.model):
            return
        self._piece_pool = None
        try:
            capture = capture or (lambda piece: self._cuda_graph(piece, "_piece_pool")[0].replay)
            self.piecewise = piecewise.PiecewiseGraphs(self.model, limit, capture)
        except RuntimeError as exc:  # a kernel that cannot be captured: such steps run eagerly, still correct
            log.warning("piecewise CUDA-graph capture failed, prefill steps run eagerly: %s",
                        str(exc).splitlines()[0])
            self.piecewise = None

    def _cuda_graph(self, fn: Callable[[], Any], pool: str) -> tuple[torch.cuda.CUDAGraph, Any]:
        """(graph, what it returned) of `fn` captured on the memory pool kept as attribute `pool` (the first
        capture's), after one eager call that compiles the kernels the capture launches, outside it."""
        with graph_warmup():
            fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=getattr(self, pool)):
            out = fn()
        setattr(self, pool, getattr(self, pool) or graph.pool())
        return graph, out

    def _replay(self, step: StepInputs, bucket: int) -> torch.Tensor:
        b = step.input_ids.shape[0]
        meta = step.meta
        self.g_ids[:b].copy_(step.input_ids)
        self.g_positions[:b].copy_(step.positions)
        self.g_slots[:b].copy_(meta.slot_mapping)
        self.g_slots[b:bucket].fill_(-1)
        self.g_context[:b].copy_(meta.context_lens)
        self.g_context[b:bucket].fill_(1)
        self.g_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.g_tables[b:bucket].zero_()
        self.graphs[bucket].replay()
        return self.g_logits[bucket][:b]

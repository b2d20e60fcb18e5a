"""Log-likelihoods of continuations given contexts, on the engine: our decoder over its paged KV pool, the
pool's prefix cache sharing every context's KV among its choices (and among documents that open alike: MMLU's
description and solved examples).

A document is a list of requests (context tokens, continuation tokens). Each distinct input (context +
continuation without its last token) becomes one sequence; the logits at its positions from the context's last
token on give the continuation's log-probabilities. A document's inputs first share a prefix sequence: their
common leading full blocks, computed once and registered in the prefix cache; every input then takes those
blocks from the cache and computes only its own tokens. Steps hold up to `max_num_batched_tokens` tokens of
many documents (a sequence longer than what is left is computed in chunks, as chunked prefill does), and the
logits of the wanted rows only are computed, their log-softmax gathered on the device.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm.auto import tqdm

from quantkit.config import UserError
from quantkit.engine.block_manager import BlockManager
from quantkit.engine.config import EngineConfig
from quantkit.engine.model_runner import ModelRunner
from quantkit.engine.sequence import Sequence

SOFTMAX_ROWS = 1024


@dataclass(frozen=True)
class ScoreRequest:
    """Token ids of a context (at least one) and of the continuation scored after it."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass
class _Input:
    """One sequence to compute: a document's shared prefix (no targets) or one of its distinct inputs, with the
    requests it scores as (request index, position of the logits of its first token, its tokens)."""

    doc: int
    tokens: list[int]
    targets: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    seq: Optional[Sequence] = None

    @property
    def first(self) -> int:
        """The first position whose logits are wanted (len(tokens) for a prefix: none)."""
        return min((start for _, start, _ in self.targets), default=len(self.tokens))


@dataclass
class _Doc:
    prefix: Optional[_Input]
    inputs: list[_Input]
    left: int = 0  # inputs not yet computed


def _common_prefix(token_lists: list[list[int]]) -> int:
    first = token_lists[0]
    n = min(len(t) for t in token_lists)
    for other in token_lists[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


class LoglikelihoodScorer:
    """Scores documents of requests on one model under one engine configuration (its KV bits, dtype, step
    budget, prefix caching); the KV pool and prefix cache live as long as the scorer."""

    def __init__(self, model, config: EngineConfig) -> None:
        self.runner = ModelRunner(model, config)
        self.block_size = config.block_size
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.budget = config.max_num_batched_tokens
        self.forward_tokens = 0  # tokens computed so far (the cache's hits excluded)

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _plan(self, index: int, requests: list[ScoreRequest]) -> _Doc:
        """The doc's distinct inputs and their shared prefix (whole blocks before every wanted position)."""
        limit = self.runner.max_model_len
        inputs: dict[tuple[int, ...], _Input] = {}
        for j, r in enumerate(requests):
            tokens = list(r.context + r.continuation[:-1])
            start = len(r.context) - 1
            cut = max(len(tokens) - limit, 0)  # lm-eval keeps the last max_length tokens
            if cut > start:
                raise UserError(f"a continuation of {len(r.continuation)} tokens does not fit the model's context "
                                f"of {limit} tokens")
            tokens, start = tokens[cut:], start - cut
            inputs.setdefault(tuple(tokens), _Input(index, tokens)).targets.append((j, start, r.continuation))
        doc = _Doc(None, list(inputs.values()), len(inputs))
        if self.blocks.prefix_caching:
            shared = min(_common_prefix([i.tokens for i in doc.inputs]), min(i.first for i in doc.inputs))
            shared -= shared % self.block_size
            if shared:
                doc.prefix = _Input(index, doc.inputs[0].tokens[:shared])
        return doc

    def _need(self, doc: _Doc) -> int:
        """Blocks the document may take from the free list, at most (as if nothing were shared)."""
        return sum(self._blocks(len(i.tokens)) for i in doc.inputs) + (self._blocks(len(doc.prefix.tokens))
                                                                       if doc.prefix else 0)

    def _start(self, item: _Input) -> bool:
        """Allocate item's sequence (cached blocks up to its first wanted position); True if it has tokens to
        compute."""
        item.seq = Sequence(item.tokens)
        self.blocks.allocate(item.seq, max_cached_tokens=item.first)
        return item.seq.num_computed_tokens < len(item.tokens)

    @torch.inference_mode()
    def score(self, docs: list[list[ScoreRequest]], desc: str = "scoring", progress: bool = True) -> list[list[float]]:
        """The summed log-probability of each request's continuation given its context, per document."""
        self.runner.model.set_kv_caches(self.runner.kv_caches)  # several scorers may share one model
        out = [[0.0] * len(d) for d in docs]
        plans = [self._plan(i, d) for i, d in enumerate(docs)]
        largest = max((self._need(p) for p in plans), default=0)
        if largest > self.blocks.num_blocks:
            raise UserError(f"a document needs {largest * self.block_size} KV tokens but the pool holds "
                            f"{self.blocks.num_blocks * self.block_size}: raise --cache-max-entry-count")
        waiting, ready = deque(plans), deque()
        reserved = 0  # free blocks promised to the inputs of admitted documents
        bar = tqdm(total=len(docs), desc=desc, unit="doc", disable=not progress, dynamic_ncols=True)

        def release(doc: _Doc) -> None:
            """Start the doc's inputs (its prefix, if any, is in the cache and still held)."""
            nonlocal reserved
            for item in doc.inputs:
                reserved -= self._blocks(len(item.tokens))
                started = self._start(item)
                assert started, "a wanted position is never taken from the cache"
                ready.appendleft(item)  # first: finished documents give their blocks back sooner

        try:
            while waiting or ready:
                # Admit documents while the next steps lack work and the pool can hold all they may take.
                while waiting and sum(len(i.tokens) - i.seq.num_computed_tokens for i in ready) < 2 * self.budget \
                        and self.blocks.num_free_blocks - reserved >= self._need(waiting[0]):
                    doc = waiting.popleft()
                    reserved += sum(self._blocks(len(i.tokens)) for i in doc.inputs)
                    if doc.prefix is not None and self._start(doc.prefix):
                        ready.append(doc.prefix)
                        continue
                    release(doc)
                    if doc.prefix is not None:  # wholly cached (another document's): the inputs hold it now
                        self.blocks.deallocate(doc.prefix.seq)
                batch = self._take(ready)
                self._run(batch, out)
                for item, _ in batch:
                    if item.seq.num_computed_tokens < len(item.seq):
                        continue
                    doc = plans[item.doc]
                    if item is doc.prefix:
                        self.blocks.hash_blocks(item.seq)
                        release(doc)
                    else:
                        doc.left -= 1
                        if doc.left == 0:
                            bar.update(1)
                    self.blocks.deallocate(item.seq)
        finally:
            bar.close()
            for item in ready:  # an error or Ctrl-C mid-run: the pool is left empty for the next call
                if item.seq.block_table:
                    self.blocks.deallocate(item.seq)
        return out

    def _take(self, ready: deque) -> list[tuple[_Input, int]]:
        """The next step: sequences from the front of `ready` up to the token budget, the last maybe a chunk."""
        batch, tokens = [], 0
        while ready and tokens < self.budget:
            item = ready[0]
            n = min(len(item.seq) - item.seq.num_computed_tokens, self.budget - tokens)
            batch.append((item, n))
            tokens += n
            if item.seq.num_computed_tokens + n < len(item.seq):
                break  # budget spent mid-sequence: its next chunk opens the next step
            ready.popleft()
        batch.sort(key=lambda b: b[1] != 1)  # one-token sequences first: the runner's decode kernel takes them
        return batch

    def _run(self, batch: list[tuple[_Input, int]], out: list[list[float]]) -> None:
        """Forward one step; add the log-probabilities of the targets it holds to `out`."""
        rows, row_of, offset = [], {}, 0  # rows of wanted positions; (item id, position) → index into rows
        for item, n in batch:
            c = item.seq.num_computed_tokens
            lo = max(item.first, c)
            for p in range(lo, c + n):
                row_of[id(item), p] = len(rows)
                rows.append(offset + p - c)
            offset += n
        pick_row, pick_token, pick_slot, slots = [], [], [], []
        for item, n in batch:
            c = item.seq.num_computed_tokens
            for j, start, cont in item.targets:
                lo, hi = max(start, c), min(start + len(cont), c + n)
                if lo >= hi:
                    continue
                base = row_of[id(item), lo]
                pick_row.extend(range(base, base + hi - lo))
                pick_token.extend(cont[lo - start:hi - start])
                pick_slot.extend([len(slots)] * (hi - lo))
                slots.append((item.doc, j))
        logits = self.runner.prompt_logits([(item.seq, n) for item, n in batch], torch.tensor(rows, dtype=torch.long))
        if slots:
            dev = logits.device
            rows_t, tokens_t = torch.tensor(pick_row, device=dev), torch.tensor(pick_token, device=dev)
            picked = torch.empty(len(pick_row), dtype=logits.dtype, device=dev)
            for a in range(0, logits.shape[0], SOFTMAX_ROWS):  # a slice at a time: no second [rows, vocab] copy
                mine = (rows_t >= a) & (rows_t < a + SOFTMAX_ROWS)
                picked[mine] = logits[a:a + SOFTMAX_ROWS].log_softmax(-1)[rows_t[mine] - a, tokens_t[mine]]
            sums = torch.zeros(len(slots), dtype=torch.float64, device=dev)
            sums.index_add_(0, torch.tensor(pick_slot, device=dev), picked.double())
            for (d, j), v in zip(slots, sums.tolist()):
                out[d][j] += v
        for item, n in batch:
            item.seq.num_computed_tokens += n
        self.forward_tokens += sum(n for _, n in batch)

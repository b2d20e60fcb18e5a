"""Scheduler: which sequences run in the next step, and with how many tokens each (continuous batching).

Every step: the running sequences that decode bring one token each (oldest first); when the pool has no
block for one, the newest running sequence is preempted (its blocks freed, its tokens recomputed when it
is readmitted). The token budget left then goes to prompts: sequences part-way through their prompt
first, then waiting ones in arrival order, admitted while the free blocks hold all their tokens. A prompt
longer than the budget is computed in chunks over several steps (chunked prefill). Requests join and
leave at any step; `abort` frees a request's blocks at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

from quantkit.config import UserError
from quantkit.engine.block_manager import BlockManager
from quantkit.engine.config import EngineConfig
from quantkit.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: (sequence, number of its next uncomputed tokens to compute) pairs, decodes first.
    A sequence whose chunk reaches its last token gets a token sampled this step (`sampled`)."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[Sequence, int]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for _, n in self.items)

    @property
    def sampled(self) -> list[Sequence]:
        return [seq for seq, n in self.items if seq.num_computed_tokens + n == len(seq)]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: Optional[int] = None) -> None:
        """max_model_len: the model's limit (its max_position_embeddings) when config.max_model_len is unset."""
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        pool_tokens = block_manager.num_blocks * self.block_size
        # A sequence stops growing ("length") here, so it can always finish alone in the pool.
        self.max_model_len = min(config.max_model_len or max_model_len or pool_tokens, pool_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order: the newest is last
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(seq) >= self.max_model_len:
            raise UserError(f"the prompt has {len(seq)} tokens but a sequence may hold at most {self.max_model_len} "
                            f"(max_model_len or the KV pool): shorten the prompt or enlarge the KV cache "
                            f"(--cache-max-entry-count, or num_kv_tokens on the CPU).")
        self.waiting.append(seq)

    def find(self, request_id: str) -> Optional[Sequence]:
        return next((s for s in (*self.running, *self.waiting) if s.request_id == request_id), None)

    def abort(self, request_id: str) -> Optional[Sequence]:
        """Finish the request now ("abort") and free its blocks; None if it is not here (already finished)."""
        seq = self.find(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End seq (a stop string found by the detokenizer, an abort, or a stop token / length in
        `append`) and give its blocks back. A stop string in the text of a step that also reached the
        length limit makes the reason "stop", as the text was cut there."""
        if seq.is_finished:
            if reason == "stop" and seq.finish_reason == "length":
                seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = self._schedule_decodes(batch, budget)
        budget -= len(batch)
        scheduled = {id(s) for s, _ in batch}
        for seq in self.running:  # prompts part-way through their chunks
            if budget == 0 or len(batch) >= self.config.max_num_seqs:
                return batch
            if id(seq) not in scheduled:
                n = min(seq.num_uncomputed_tokens, budget)
                batch.items.append((seq, n))
                budget -= n
        # A step that had to preempt admits nobody: the freed blocks are the preempted sequences' to take back.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.has_pending or not self.block_manager.can_allocate(seq):  # its last token is not back yet
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> bool:
        """Add every decoding sequence that fits (oldest first), preempting the newest running sequences for
        blocks; returns whether any was preempted."""
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            i += 1
            if seq.num_uncomputed_tokens != 1:
                continue
            if len(batch) >= min(budget, self.config.max_num_seqs):
                break
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                batch.items.append((seq, 1))
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it first in line; readmitted, it recomputes its tokens (prompt and
        output so far) in one prefill."""
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def account(self, batch: ScheduledBatch) -> None:
        """The step's tokens are computed: count them and register the blocks they filled; then `append`
        each sampled token. Read `batch.sampled` before this (it is computed from what is not yet counted). Sequences finished
        meanwhile (a request failed while its token was sampled) hold no blocks and are skipped."""
        for seq, n in batch:
            if not seq.is_finished:
                seq.num_computed_tokens += n
                self.block_manager.hash_blocks(seq)

    def append(self, seq: Sequence, token_id: int, logprobs: Optional[object] = None) -> None:
        """seq's sampled token: append it, finish seq on a stop token ("stop"), its max_tokens or the
        length limit ("length")."""
        token_id = int(token_id)
        seq.append_token(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        if token_id in seq.stop_ids:
            self.finish(seq, "stop", token_id if token_id in seq.params.stop_token_ids else None)
        elif seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            self.finish(seq, "length")

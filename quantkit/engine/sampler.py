"""Sampler: the next token of every sequence of a step, each with its own settings, in one batch on the device.

Order, as transformers applies its processors: end/stop tokens held back until min_tokens, penalties, then greedy rows take the
argmax; the others divide by their temperature, keep their top-k, then their top-p nucleus, drop tokens
under min_p × the top probability, and draw from what is left. A draw is argmax(p / q) with q ~ Exp(1)
(the exponential race, equal in law to sampling from p); a seeded request draws its q from its own
generator, so its tokens depend on its seed only, not on the requests batched with it.
Log-probabilities are those of the model's own distribution (log-softmax of the raw logits), as vLLM's.
A sequence with a grammar (engine/structured.py) first has the tokens its grammar forbids set to -inf.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.engine.sequence import Sequence
from quantkit.engine.structured import GrammarMask

GREEDY_BELOW = 1e-5  # temperatures under this are greedy: dividing by them overflows


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the k most likely tokens' (id, log-probability), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class PenaltyTokens:
    """HF's repetition penalty over the prompt and the output; OpenAI's presence / frequency penalties over
    the output. Their token state lives on the logits' device and each call brings it up to date with the
    tokens appended since the last one (one scatter for the batch): host work per step does not grow with
    the context.

    A sequence that sets a penalty gets a row of two pooled tensors when first sampled: `prompt_seen`
    [rows, vocab] bool marks its prompt's tokens, `output_counts` [rows, vocab] int32 counts its output's.
    Pooled rather than a tensor per sequence so that a batch's rows are read with one gather and its new
    tokens counted with one scatter, whatever the batch size. A row costs 5 bytes × vocab (0.76 MB at a
    152k vocabulary, 195 MB for 256 sequences); the pool doubles when full and keeps its size. A finished
    or dropped sequence's row goes to the next sequence that needs one; a preempted sequence keeps its row,
    as it keeps its tokens. Ids outside [0, vocab) (image placeholders) have no logit and are not counted."""

    def __init__(self) -> None:
        self.prompt_seen: Optional[torch.Tensor] = None
        self.output_counts: Optional[torch.Tensor] = None
        self._one: Optional[torch.Tensor] = None         # the count each appended token adds, on the device
        self._owners: list[Optional[weakref.ref]] = []  # row → the sequence holding it; None: free
        self._state = weakref.WeakKeyDictionary()         # sequence → [row, output tokens counted; None: none yet]

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Returns logits itself when no sequence sets a penalty, else a penalised copy."""
        rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
                or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
        if not rows:
            return logits
        sub = [seqs[i] for i in rows]
        index = self._sync(sub, logits.shape[1], logits.device)
        counts = self.output_counts[index]
        present = counts > 0
        seen = self.prompt_seen[index] | present
        knobs = torch.tensor([[s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty]
                              for s in sub], device=logits.device)
        rep, presence, frequency = knobs[:, 0:1], knobs[:, 1:2], knobs[:, 2:3]
        x = logits[rows]
        logits = logits.clone()
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - presence * present - frequency * counts
        logits[rows] = x
        return logits

    def _sync(self, seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
        """Count into each sequence's row what it appended since the last call (its prompt and all its output
        for a new row); returns the rows' indices on the device. What a row has counted is recorded only
        after the scatters succeed, and a row not yet complete is cleared and built again: a call that
        raises leaves each row to be brought up to date by the next."""
        if self.prompt_seen is None or self.prompt_seen.shape[1] != vocab or self.prompt_seen.device != device:
            self._reset(vocab, device)
        states = [self._state.get(s) or self._take_row(s, seqs) for s in seqs]
        new = [(st[0], s.prompt_token_ids) for s, st in zip(seqs, states) if st[1] is None]
        if new:
            taken = [row for row, _ in new]
            self.prompt_seen[taken] = False  # a row taken over still holds its last owner's tokens
            self.output_counts[taken] = 0
            self.prompt_seen.index_put_(_pairs(new, vocab, device), self._one.bool())
        appended = [(st[0], s.token_ids[s.num_prompt_tokens + (st[1] or 0):]) for s, st in zip(seqs, states)]
        self.output_counts.index_put_(_pairs(appended, vocab, device), self._one, accumulate=True)
        for s, st in zip(seqs, states):
            st[1] = s.num_output_tokens
        return torch.tensor([st[0] for st in states], device=device)

    def _reset(self, vocab: int, device: torch.device) -> None:
        """An empty pool for this vocabulary and device (another model's logits: every row starts over)."""
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self._one = torch.ones((), dtype=torch.int32, device=device)
        self._owners.clear()
        self._state.clear()

    def _take_row(self, seq: Sequence, batch: list[Sequence]) -> list:
        """A free row for seq: one never used, one whose sequence finished (outside this batch) or was dropped,
        else a new one from a doubled pool."""
        batch_ids = {id(s) for s in batch}
        row = next((r for r, ref in enumerate(self._owners) if _reclaimable(ref, batch_ids)), None)
        if row is None:
            row = len(self._owners)
            self._grow()
        previous = self._owners[row] and self._owners[row]()
        if previous is not None:
            self._state.pop(previous, None)
        self._owners[row] = weakref.ref(seq)
        state = self._state[seq] = [row, None]
        return state

    def _grow(self) -> None:
        n, vocab = self.prompt_seen.shape
        size = max(8, 2 * n)
        seen, counts = self.prompt_seen.new_zeros(size, vocab), self.output_counts.new_zeros(size, vocab)
        seen[:n], counts[:n] = self.prompt_seen, self.output_counts
        self.prompt_seen, self.output_counts = seen, counts
        self._owners += [None] * (size - n)


def _reclaimable(ref: Optional[weakref.ref], batch_ids: set[int]) -> bool:
    seq = ref() if ref is not None else None
    return seq is None or (seq.is_finished and id(seq) not in batch_ids)


def _pairs(rows_tokens: list[tuple[int, list[int]]], vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(row ids, token ids) on the device, one pair per token of each row's list; ids outside [0, vocab) left
    out. Built on the host in one tensor, moved in one copy."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, toks in rows_tokens:
        rows += [row] * len(toks)
        tokens += toks
    pairs = torch.tensor([rows, tokens], dtype=torch.long)
    inside = (pairs[1] >= 0) & (pairs[1] < vocab)
    if not bool(inside.all()):
        pairs = pairs[:, inside]
    return tuple(pairs.to(device))


def pinned_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host's copy on `device`: on CUDA through pinned memory, queued behind the work on the stream rather
    than waiting for it (a copy from pageable memory blocks the host until the stream is idle, which would
    stall asynchronous scheduling on the step in flight)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: list, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A small tensor of `values` (a step's sampling settings) on `device`, by `pinned_copy`."""
    return pinned_copy(torch.tensor(values, dtype=dtype), device)


def hold_back_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """-inf on the end and stop tokens of the sequences that have fewer than their min_tokens out. Returns
    logits itself when none has, else a masked copy."""
    rows = [i for i, s in enumerate(seqs) if s.params.min_tokens > s.num_output_tokens and s.stop_ids
            and getattr(s, "grammar", None) is None]   # a grammar decides where its text ends
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        ids = to_device(sorted(seqs[i].stop_ids), logits.device, torch.long)
        logits[i, ids[ids < logits.shape[1]]] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k (0: all), then outside its top-p nucleus (the fewest most likely tokens
    whose probability, renormalised after top-k, reaches top_p), then under min_p × its top probability.
    The most likely token always stays."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # probability of the tokens ranked above
    drop = (mass_before >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1)  # float sums reach 1 early
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self) -> None:
        self.generator: Optional[torch.Generator] = None  # shared by the unseeded requests
        self.penalties = PenaltyTokens()
        self.grammars = GrammarMask()

    def __call__(self, logits: torch.Tensor,
                 seqs: list[Sequence]) -> tuple[torch.Tensor, list[Optional[TokenLogprobs]]]:
        """logits [N, vocab] float32 of the N sequences' last tokens → (token ids [N] int64 on the device,
        per-sequence TokenLogprobs or None where the request did not ask)."""
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        # First: the grammars' bitmask rows are filled on the host while the device still runs the forward.
        raw = logits
        logits = self.grammars.apply(logits, seqs, copy=any(s.params.logprobs is not None for s in seqs))
        logits = self.penalties.apply(hold_back_stops(logits, seqs), seqs)
        temps = [s.params.temperature for s in seqs]
        greedy_ids = logits.argmax(dim=1)
        if all(t < GREEDY_BELOW for t in temps):
            token_ids = greedy_ids
        else:
            token_ids = torch.where(self._greedy_mask(temps, logits.device), greedy_ids, self._sample(logits, seqs))
        return token_ids, self._logprobs(raw, token_ids, seqs)

    @staticmethod
    def _greedy_mask(temps: list[float], device) -> torch.Tensor:
        return to_device([t < GREEDY_BELOW for t in temps], device)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        temps = to_device([max(s.params.temperature, GREEDY_BELOW) for s in seqs], dev)
        logits = logits / temps[:, None]
        if any(s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0 for s in seqs):
            logits = filter_logits(
                logits, to_device([s.params.top_k for s in seqs], dev), to_device([s.params.top_p for s in seqs], dev),
                to_device([s.params.min_p for s in seqs], dev))
        probs = logits.softmax(dim=1)
        return (probs / self._exponential(probs, seqs)).argmax(dim=1)

    def _exponential(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exp(1) noise of probs' shape: seeded rows from their own generators, the rest from a shared one."""
        if self.generator is None or self.generator.device != probs.device:
            self.generator = torch.Generator(device=probs.device)
            self.generator.seed()
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is None or seq.params.temperature < GREEDY_BELOW:
                continue
            if seq.generator is None:
                seq.generator = torch.Generator(device=probs.device).manual_seed(seq.params.seed)
            q[i].exponential_(generator=seq.generator)
        return q.clamp_(min=1e-10)

    @staticmethod
    def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, seqs: list[Sequence]) -> list[Optional[TokenLogprobs]]:
        wanted = [s.params.logprobs for s in seqs]
        if all(k is None for k in wanted):
            return [None] * len(seqs)
        logp = raw.float().log_softmax(dim=1)
        chosen = logp.gather(1, token_ids[:, None]).squeeze(1).tolist()
        k_max = min(max(k for k in wanted if k is not None), logp.shape[1])
        top_vals, top_ids = logp.topk(k_max, dim=1) if k_max else (logp[:, :0], token_ids[:, None][:, :0])
        top_vals, top_ids, ids = top_vals.tolist(), top_ids.tolist(), token_ids.tolist()
        return [None if k is None else TokenLogprobs(ids[i], chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k])))
                for i, k in enumerate(wanted)]

"""Sampler: the next token of every sequence of a step, each with its own settings, in one batch on the device.

Order, as transformers applies its processors: end/stop tokens held back until min_tokens, penalties, then greedy rows take the
argmax; the others divide by their temperature, keep their top-k, then their top-p nucleus, drop tokens
under min_p × the top probability, and draw from what is left. A draw is argmax(p / q) with q ~ Exp(1)
(the exponential race, equal in law to sampling from p); a seeded request draws its q from its own
generator, so its tokens depend on its seed only, not on the requests batched with it.
Log-probabilities are those of the model's own distribution (log-softmax of the raw logits), as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.engine.sequence import Sequence

GREEDY_BELOW = 1e-5  # temperatures under this are greedy: dividing by them overflows


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the k most likely tokens' (id, log-probability), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """HF's repetition penalty over the prompt and the output; OpenAI's presence / frequency penalties over
    the output. Returns logits itself when no sequence sets any, else a penalised copy."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
            or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
    if not rows:
        return logits
    vocab, dev = logits.shape[1], logits.device
    sub = [seqs[i] for i in rows]
    seen = _token_counts([s.token_ids for s in sub], vocab, dev) > 0
    counts = _token_counts([s.output_token_ids for s in sub], vocab, dev)
    rep = torch.tensor([s.params.repetition_penalty for s in sub], device=dev)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in sub], device=dev)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in sub], device=dev)[:, None]
    x = logits[rows]
    logits = logits.clone()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - presence * (counts > 0) - frequency * counts
    logits[rows] = x
    return logits


def hold_back_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """-inf on the end and stop tokens of the sequences that have fewer than their min_tokens out. Returns
    logits itself when none has, else a masked copy."""
    rows = [i for i, s in enumerate(seqs) if s.params.min_tokens > s.num_output_tokens and s.stop_ids]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        ids = torch.tensor(sorted(seqs[i].stop_ids), dtype=torch.long, device=logits.device)
        logits[i, ids[ids < logits.shape[1]]] = float("-inf")
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how many times each token occurs in each list."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width + 1), vocab, dtype=torch.long)  # vocab: a spill column
    for i, t in enumerate(token_lists):
        padded[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


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

    def __call__(self, logits: torch.Tensor,
                 seqs: list[Sequence]) -> tuple[torch.Tensor, list[Optional[TokenLogprobs]]]:
        """logits [N, vocab] float32 of the N sequences' last tokens → (token ids [N] int64 on the device,
        per-sequence TokenLogprobs or None where the request did not ask)."""
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        raw = logits
        logits = apply_penalties(hold_back_stops(logits, seqs), seqs)
        temps = [s.params.temperature for s in seqs]
        greedy_ids = logits.argmax(dim=1)
        if all(t < GREEDY_BELOW for t in temps):
            token_ids = greedy_ids
        else:
            token_ids = torch.where(self._greedy_mask(temps, logits.device), greedy_ids, self._sample(logits, seqs))
        return token_ids, self._logprobs(raw, token_ids, seqs)

    @staticmethod
    def _greedy_mask(temps: list[float], device) -> torch.Tensor:
        return torch.tensor([t < GREEDY_BELOW for t in temps], device=device)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([max(s.params.temperature, GREEDY_BELOW) for s in seqs], device=dev)
        logits = logits / temps[:, None]
        if any(s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0 for s in seqs):
            logits = filter_logits(
                logits, torch.tensor([s.params.top_k for s in seqs], device=dev),
                torch.tensor([s.params.top_p for s in seqs], device=dev),
                torch.tensor([s.params.min_p for s in seqs], device=dev))
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

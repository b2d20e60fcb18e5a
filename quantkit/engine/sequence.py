"""Sequence: one request's tokens, where it stands, and the KV blocks that hold it."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import Optional, Union

from quantkit.engine.config import SamplingParams

# The id a sequence holds for a token sampled by a step still running on the device (asynchronous scheduling,
# engine/llm_engine.py): the next step reads the token from the device, and the engine writes it here when the
# step's tokens come back.
PENDING = -1


class SequenceStatus(Enum):
    WAITING = auto()   # no blocks: not yet admitted, or preempted (its cache is recomputed when readmitted)
    RUNNING = auto()   # holds blocks; prefilling (possibly in chunks) or decoding
    FINISHED = auto()


class Sequence:
    """A request's prompt and output tokens. `num_computed_tokens` of them have their K/V in the cache
    (in the blocks of `block_table`); the rest are computed by the next steps. After the prompt, each
    step computes the last token and samples the next."""

    _arrivals = itertools.count()

    def __init__(self, token_ids: list[int], params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None) -> None:
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.arrival = next(Sequence._arrivals)
        self.request_id = str(self.arrival) if request_id is None else request_id
        params = params or SamplingParams()
        self.params = params if params.is_resolved else params.with_defaults(None)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []               # prefix-cache keys of its leading full blocks (block_manager)
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None       # "stop", "length" or "abort"
        self.stop_reason: Union[int, str, None] = None  # the stop token id or stop string that ended it
        self.output_logprobs: list = []                 # one entry per output token when params.logprobs is set
        self.generator = None                           # the sampler's torch.Generator for a seeded request
        self.images = None                              # multimodal.ImageInputs of a prompt with images
        self.grammar = None                             # XGrammar's matcher when params.structured is set
        self.pending_row: Optional[int] = None          # the row of its PENDING token in the step in flight
        eos = [] if self.params.ignore_eos else self.params.eos_token_ids
        self.stop_ids = frozenset(self.params.stop_token_ids) | frozenset(eos)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def has_pending(self) -> bool:
        """Whether its last token is PENDING: sampled by the step in flight, not yet read back."""
        return self.pending_row is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to put in the cache: 1 for a decoding sequence, more while prefilling."""
        return len(self.token_ids) - self.num_computed_tokens

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every token."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def block(self, i: int, block_size: int) -> list[int]:
        """The token ids of block i."""
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

"""IncrementalDetokenizer: a sequence's output text as its tokens arrive, and its stop strings.

Token ids do not map to text one by one: a character may span several byte-fallback tokens, and
sentencepiece pieces change the spaces around them with their neighbours. So each step decodes a short
window of tokens twice, without and with the new ones, and emits the difference (vLLM's method); while
the window ends in an incomplete character (decoded as U+FFFD) nothing is emitted. The window starts a
few tokens into the prompt so the first output token gets the spacing it has in context.

Stop strings are searched in the output text as it grows; the text from a stop string on is never
emitted. Until the sequence ends, the last (longest stop string − 1) characters are held back, since they
may be the start of a stop string.
"""

from __future__ import annotations

from typing import Callable, Optional

from quantkit.engine.sequence import Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for its spacing
INCOMPLETE = "\ufffd"


def token_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids → text as `tokenizer.decode(ids, skip_special_tokens=…, clean_up_tokenization_spaces=False)`.

    For a transformers fast tokenizer whose class keeps the base decode, that is exactly its Rust
    tokenizer's decode: called directly, without the Python wrapper's argument handling (≈ 2× faster;
    two calls per token and sequence add up at large batches)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the wrapper it is
        TokenizersBackend = PreTrainedTokenizerBase = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and type(tokenizer)._decode is TokenizersBackend._decode
            and type(tokenizer).decode is PreTrainedTokenizerBase.decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, seq: Sequence, skip_special_tokens: Optional[bool] = None) -> None:
        """skip_special_tokens: None takes the sequence's own setting (SamplingParams.skip_special_tokens)."""
        if skip_special_tokens is None:
            skip_special_tokens = seq.params.skip_special_tokens
        self.tokenizer, self.seq, self.skip_special_tokens = tokenizer, seq, skip_special_tokens
        self.decode = token_decoder(tokenizer, skip_special_tokens)
        self._prefix: tuple[int, int, str] = (-1, -1, "")  # (start, end, text) of the last prefix decoded
        self.prefix_offset = max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0)
        self.read_offset = seq.num_prompt_tokens   # tokens before this are in `text`
        self.num_seen = seq.num_prompt_tokens      # tokens before this have been given to the decoder
        self.text = ""                             # the output text so far (cut at a stop string)
        self.num_emitted = 0                       # characters of `text` returned as deltas
        self.stop_strings = list(seq.params.stop)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.stop_string: Optional[str] = None     # the stop string found, once found

    @property
    def stopped(self) -> bool:
        """A stop string was found: the engine finishes the sequence with reason "stop"."""
        return self.stop_string is not None

    def step(self, new_token_id: Optional[int] = None) -> str:
        """The text that the tokens appended to the sequence since the last call add (new_token_id, when
        given, is the last of them). A sequence finished by a stop token adds no text for that token; once
        the sequence is finished, everything held back is returned."""
        tokens = self.seq.token_ids
        if new_token_id is not None:
            assert tokens[-1] == new_token_id, "step() follows the sequence: append the token first"
        if self.stopped:
            return ""
        end = len(tokens)
        finished = self.seq.is_finished
        if finished and self._ended_by_stop_token():
            end -= 1
        text_before = len(self.text)
        if end > self.num_seen or (finished and end > self.read_offset):  # new tokens, or held ones to flush
            self.num_seen = max(self.num_seen, end)
            self.text += self._decode_new(end, flush=finished)
        self._find_stop_string(text_before)
        limit = len(self.text) if (finished or self.stopped) else len(self.text) - self.hold
        delta = self.text[self.num_emitted:limit] if limit > self.num_emitted else ""
        self.num_emitted += len(delta)
        return delta

    def _ended_by_stop_token(self) -> bool:
        seq = self.seq
        by_string = isinstance(seq.stop_reason, str)
        return seq.finish_reason == "stop" and not by_string and seq.token_ids[-1] in seq.stop_ids

    def _decode(self, start: int, end: int) -> str:
        return self.decode(self.seq.token_ids[start:end])

    def _decode_new(self, end: int, flush: bool) -> str:
        """Text of tokens[read_offset:end] in the context of tokens[prefix_offset:read_offset]; '' while it
        ends in an incomplete character (unless flushing: the sequence ended)."""
        start, stop, prefix_text = self._prefix
        if (start, stop) != (self.prefix_offset, self.read_offset):  # the window moved: decode its prefix
            prefix_text = self._decode(self.prefix_offset, self.read_offset)
            self._prefix = (self.prefix_offset, self.read_offset, prefix_text)
        new_text = self._decode(self.prefix_offset, end)
        if len(new_text) <= len(prefix_text) and not flush:
            return ""
        if new_text.endswith(INCOMPLETE) and not flush:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return new_text[len(prefix_text):]

    def _find_stop_string(self, text_before: int) -> None:
        """Cut `text` at the earliest stop string that the new text completes."""
        if not self.stop_strings or len(self.text) == text_before:
            return
        best = None
        for stop in self.stop_strings:
            i = self.text.find(stop, max(text_before - len(stop) + 1, 0))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            self.text = self.text[:best[0]]
            self.stop_string = best[1]

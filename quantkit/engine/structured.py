"""Structured output: a request's grammar and the token bitmask that keeps its sampled tokens on it.

A `StructuredOutput` names what the text must be: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar (XGrammar's dialect, GBNF-like). `Grammars`
compiles it with XGrammar against the model's tokenizer and vocabulary, once per distinct grammar
(XGrammar's compiler keeps the compiled grammars in a cache keyed by their text), and gives each
sequence a matcher of its own. Every step, `GrammarMask` fills one bitmask row per constrained
sequence (on the host, before anything waits for the forward: the GPU computes while the rows are
filled; several rows are filled by XGrammar's threads), copies the rows to the logits' device and sets
the logits of the tokens the grammar forbids to -inf there. Sequences without a grammar are not
touched, and a step without any costs one list comprehension.

JSON comes out compact (no free whitespace between tokens): a model cannot pad it with endless
whitespace, and every value the schema bounds is bounded in length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from quantkit.config import UserError, read_json_schema

if TYPE_CHECKING:
    import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
COMPILER_CACHE_BYTES = 256 * 2**20   # compiled grammars kept (least recently used go first)


class GrammarError(UserError):
    """A grammar that XGrammar refuses (an invalid or unsupported schema, regex or EBNF grammar)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's text must be. `kind` is one of KINDS; `spec` is the JSON schema as JSON text
    (json_schema), the regular expression (regex), the EBNF grammar (grammar), the JSON list of the
    allowed strings (choice), XGrammar's structural tag as JSON text (structural_tag: text with tagged
    parts such as tool calls, each under its own format), or "" (json_object: any JSON object). Build one
    with the class methods."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise UserError(f"a {self.kind} grammar's spec is text, not {type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: Union[dict, str]) -> "StructuredOutput":
        """Text that is a JSON value valid under `schema` (a dict, or its JSON text)."""
        if not isinstance(schema, str):
            schema = json.dumps(schema, ensure_ascii=False, sort_keys=False)
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        """Text that is any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        """Text that matches `pattern` whole."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "StructuredOutput":
        """Text that is exactly one of `options`."""
        if not options or not all(isinstance(o, str) for o in options):
            raise UserError("a choice needs a non-empty list of strings")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredOutput":
        """Text that the EBNF grammar's `root` rule derives."""
        return cls("grammar", ebnf)

    @classmethod
    def structural_tag(cls, tag: Union[dict, str]) -> "StructuredOutput":
        """Text that XGrammar's structural tag ({"type": "structural_tag", "format": …}) describes."""
        return cls("structural_tag", tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False))

    def as_format(self) -> dict:
        """This grammar as a structural tag's format (to combine it with others)."""
        if self.kind == "json_schema":
            return {"type": "json_schema", "json_schema": json.loads(self.spec)}
        if self.kind == "json_object":
            return {"type": "json_schema", "json_schema": {"type": "object"}}
        if self.kind == "regex":
            return {"type": "regex", "pattern": self.spec}
        if self.kind == "grammar":
            return {"type": "grammar", "grammar": self.spec}
        if self.kind == "choice":
            return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(self.spec)]}
        return json.loads(self.spec)["format"]

    @classmethod
    def from_options(cls, json_schema_file: Optional[str] = None, regex: Optional[str] = None,
                     choice: Optional[list[str]] = None) -> Optional["StructuredOutput"]:
        """The grammar of `quantkit generate --json-schema FILE / --regex / --choice` (at most one; None
        for none)."""
        given = [name for name, v in (("--json-schema", json_schema_file), ("--regex", regex), ("--choice", choice))
                 if v]
        if len(given) > 1:
            raise UserError(f"{' and '.join(given)} both constrain the text: give one")
        if json_schema_file:
            return cls.json_schema(read_schema(json_schema_file))
        if regex:
            return cls.regex(regex)
        return cls.choice(list(choice)) if choice else None

    @property
    def size(self) -> int:
        """Characters of the grammar's text (what a server caps)."""
        return len(self.spec)


def read_schema(path: str) -> dict:
    """A JSON schema from a file (config.read_json_schema)."""
    return read_json_schema(path)


def _error_text(exc: Exception) -> str:
    """XGrammar's message without its '[time] /path/file.cc:123: ' prefix and its C++ check noise."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)


class Grammars:
    """Compiles StructuredOutputs for one tokenizer and vocabulary and makes their matchers. Thread-safe:
    the server validates grammars from a pool of threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: Optional[int] = None) -> None:
        """max_threads: XGrammar's compile threads (default: the CPU's cores, at most 8)."""
        import os

        try:
            import xgrammar as xgr
        except ImportError:
            raise UserError("structured output needs XGrammar, which is not installed: pip install 'xgrammar>=0.2.9'") from None

        max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))

        if tokenizer is None:
            raise UserError("structured output needs the model's tokenizer: this engine has none")
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True,
                                            cache_limit_bytes=COMPILER_CACHE_BYTES)
        self._json_mask: Optional[torch.Tensor] = None

    def compile(self, structured: StructuredOutput) -> Any:
        """XGrammar's CompiledGrammar (from the cache when this grammar was compiled before); GrammarError
        when it is invalid or unsupported."""
        kind, spec = structured.kind, structured.spec
        try:
            if kind == "json_schema":
                json.loads(spec)   # a clear message for text that is not JSON at all
                return self.compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                options = json.loads(spec)
                return self.compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(o, ensure_ascii=False) for o in options))
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(spec)
            return self.compiler.compile_grammar(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:   # XGrammar's errors are RuntimeErrors
            what = {"json_schema": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
                    "choice": "choice", "grammar": "EBNF grammar", "structural_tag": "structural tag"}[kind]
            raise GrammarError(f"the {what} cannot be used for structured output: {_error_text(exc)}") from None

    def check(self, structured: StructuredOutput) -> None:
        """Compile the grammar and make sure that some token can start it: GrammarError when it is invalid,
        unsupported, or derives no text that this vocabulary can write (`root ::= root`)."""
        matcher = self._xgr.GrammarMatcher(self.compile(structured), terminate_without_stop_token=True)
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool((bitmask != 0).any()) and not matcher.is_terminated():
            raise GrammarError("the grammar derives no text that this model's tokens can write: fix it")

    def matcher(self, structured: StructuredOutput, stop_ids: frozenset) -> "SequenceGrammar":
        """A fresh matcher of the grammar for one sequence. Its end is one of `stop_ids` (the sequence's
        end and stop tokens), allowed only where the grammar is complete; without any, the matcher ends
        itself when the grammar is complete (the engine then finishes the sequence)."""
        compiled = self.compile(structured)
        stops = sorted(t for t in stop_ids if 0 <= t < self.vocab_size)
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)
        return SequenceGrammar(matcher, self.json_mask() if structured.kind in ("json_schema", "json_object")
                               else None)

    def json_mask(self) -> "torch.Tensor":
        """A bitmask row that allows every token but those holding a control character (bytes 0-31).
        XGrammar's JSON strings let them through, but JSON forbids them unescaped in a string, and compact
        JSON has no whitespace outside strings: a JSON grammar's rows are ANDed with it."""
        if self._json_mask is None:
            import torch

            allowed = torch.tensor([not any(b < 32 for b in piece) for piece in self.info.decoded_vocab]
                                   + [True] * (self.vocab_size - len(self.info.decoded_vocab)))
            words = (self.vocab_size + 31) // 32
            bits = torch.zeros(words * 32, dtype=torch.int64)
            bits[:self.vocab_size] = allowed[:self.vocab_size].long()
            weights = 2 ** torch.arange(32, dtype=torch.int64)
            packed = (bits.view(words, 32) * weights).sum(dim=1)
            self._json_mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return self._json_mask


class SequenceGrammar:
    """One sequence's place in its grammar: XGrammar's matcher, and a bitmask row ANDed with the matcher's
    every step (or None)."""

    def __init__(self, matcher: Any, extra_mask: Optional["torch.Tensor"]) -> None:
        self.matcher, self.extra_mask = matcher, extra_mask

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarMask:
    """Sets the logits of the tokens that each constrained sequence's grammar forbids to -inf, for one
    step's batch at a time. Keeps a host bitmask buffer (pinned for a CUDA device) between steps."""

    def __init__(self) -> None:
        self._host: Optional[torch.Tensor] = None
        self._batch = None   # xgrammar.BatchGrammarMatcher, made with the first batch of several rows

    def apply(self, logits: torch.Tensor, seqs: list, copy: bool) -> torch.Tensor:
        """logits [N, vocab] of seqs → logits with the constrained rows masked: logits itself when no
        sequence has a grammar, else masked in place (or in a copy when `copy`, so that the caller keeps
        the raw logits for log-probabilities)."""
        rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if not rows:
            return logits
        import xgrammar as xgr

        bitmask = self._buffer(len(seqs), logits.shape[1], logits.device)
        grammars = [seqs[i].grammar for i in rows]
        matchers = [g.matcher for g in grammars]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        extra = [(i, g.extra_mask) for i, g in zip(rows, grammars) if g.extra_mask is not None]
        if extra:   # JSON rows share one mask: one operation for all of them
            masks = {id(m): m for _, m in extra}
            for mask in masks.values():
                these = [i for i, m in extra if m is mask]
                bitmask[these] &= mask
        if copy:
            logits = logits.clone()
        on_device = bitmask.to(logits.device, non_blocking=True) if logits.device.type != "cpu" else bitmask
        xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=logits.shape[1],
                                        indices=None if len(rows) == len(seqs) else rows)
        return logits

    def _buffer(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        import torch

        words = (vocab + 31) // 32
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words:
            size = max(rows, 2 * (host.shape[0] if host is not None and host.shape[1] == words else 0), 8)
            host = torch.full((size, words), -1, dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory()
            self._host = host
        return host[:rows]


def accept(seq: Any, token_id: int) -> None:
    """Advance seq's matcher by its sampled token; a token its grammar refuses is that request's error."""
    if not seq.grammar.matcher.accept_token(int(token_id)):
        raise RuntimeError(f"the request's grammar allows no token after {seq.num_output_tokens} tokens "
                           f"(token {token_id} was drawn from nothing)")

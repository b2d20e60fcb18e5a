"""`RequestLimits`: the caps on one HTTP request that `quantkit serve` checks before any work is done.

Kept apart from protocol.py (pydantic) so that the command line can state the defaults in `--help`
without importing the server. Each cap bounds work done per request outside the engine's own budget:
the body is read and parsed whole, every prompt is tokenized, every message goes through the chat
template and every stop string is scanned at every step, all before the context length is known; a
grammar is compiled against the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from quantkit.config import UserError

MiB = 2**20


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request. The defaults are generous for real clients; each with a flag can be raised."""

    max_request_bytes: int = 16 * MiB   # --max-request-bytes: a longer body is answered 413
    # --max-prompts-per-request: the engine's default batch (--max-num-seqs 256), so that one request
    # can still fill a batch; a longer list would only queue behind itself.
    max_prompts_per_request: int = 256
    max_messages: int = 1024            # --max-messages: chat turns per request
    max_stop: int = 16                  # --max-stop: stop strings per request
    max_stop_chars: int = 512           # characters per stop string
    max_json_depth: int = 64            # nesting of the body's arrays and objects (a valid request has 5)
    # --max-grammar-chars: a structured-output grammar's text (a JSON schema, the tools' schemas, a regex,
    # choices, EBNF); --grammar-compile-timeout: seconds its compilation may take before a 400
    max_grammar_chars: int = 64 * 1024
    grammar_compile_timeout: int = 10

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"--{f.name.replace('_', '-')} {value!r} must be a positive integer")

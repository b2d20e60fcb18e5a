"""Structured output on the HTTP side: the grammar a request asks for, and its check before the engine
sees it.

A request names at most one grammar, in any of the forms clients send: OpenAI's `response_format`
(`json_object`, or `json_schema` with its `schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`, `structural_tag`) or its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. `requested_grammar` turns it into the engine's `StructuredOutput`; two of them in one
request are a 400.

`GrammarChecker` compiles each grammar here first, with the same tokenizer and vocabulary as the
engine, in a small thread pool and under `--grammar-compile-timeout`: an invalid or unsupported schema,
regex or grammar, or one that compiles too slowly, is a 400 naming the field, before any engine work.
Compiled grammars stay in XGrammar's cache, so a schema sent again is checked at once (the engine keeps
its own cache; each compiles a distinct grammar once). A compilation past the timeout cannot be
interrupted: it finishes in its thread, and the pool's two threads bound how many run at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from quantkit.config import UserError
from quantkit.engine.structured import Grammars, StructuredOutput
from quantkit.server.limits import RequestLimits
from quantkit.server.protocol import APIError

log = logging.getLogger(__name__)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text; 400 for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param=param, code="invalid_value") from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param, code="invalid_value")
    return json.dumps(value, ensure_ascii=False)


def requested_grammar(req: Any) -> tuple[Optional[StructuredOutput], Optional[str]]:
    """(the grammar the request asks for, the field that asked) or (None, None). 400 when it asks in
    two ways, or gives an empty regex, choice or grammar."""
    found: list[tuple[StructuredOutput, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((StructuredOutput.json_object(), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema)",
                           param="response_format.json_schema.schema", code="missing_required_parameter")
        found.append((StructuredOutput.json_schema(_schema_text(schema, "response_format.json_schema.schema")),
                      "response_format"))
    so = req.structured_outputs
    fields = [("structured_outputs.json", so.json_ if so else None), ("structured_outputs.regex", so.regex if so else None),
              ("structured_outputs.choice", so.choice if so else None),
              ("structured_outputs.grammar", so.grammar if so else None),
              ("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
              ("guided_choice", req.guided_choice), ("guided_grammar", req.guided_grammar)]
    for param, value in fields:
        if value is None:
            continue
        kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
        if kind in ("regex", "grammar") and not value:
            raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
        if kind == "choice" and not value:
            raise APIError(400, f"{param} needs at least one string", param=param, code="invalid_value")
        grammar = (StructuredOutput.json_schema(_schema_text(value, param)) if kind == "json" else
                   StructuredOutput.regex(value) if kind == "regex" else
                   StructuredOutput.choice(value) if kind == "choice" else StructuredOutput.grammar(value))
        found.append((grammar, param))
    if so is not None and so.json_object:
        found.append((StructuredOutput.json_object(), "structured_outputs.json_object"))
    if so is not None and so.structural_tag is not None:
        param = "structured_outputs.structural_tag"
        tag = json.loads(_schema_text(so.structural_tag, param))
        if tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
            raise APIError(400, f'{param} must be {{"type": "structural_tag", "format": {{…}}}} (XGrammar\'s)',
                           param=param, code="invalid_value")
        found.append((StructuredOutput.structural_tag(tag), param))
    if len(found) > 1:
        raise APIError(400, f"the request asks for structured output in {len(found)} ways ("
                       + ", ".join(p for _, p in found) + "): give one", param=found[1][1], code="invalid_value")
    return found[0] if found else (None, None)


class GrammarChecker:
    """Compiles grammars on the HTTP side (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: RequestLimits) -> None:
        self.tokenizer, self.vocab_size, self.limits = tokenizer, vocab_size, limits
        self._grammars: Optional[Grammars] = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="quantkit-grammar")

    async def check(self, grammar: StructuredOutput, param: str) -> None:
        """400 naming `param` when the grammar is longer than --max-grammar-chars, invalid, unsupported,
        derives no text, or compiles for longer than --grammar-compile-timeout."""
        cap = self.limits.max_grammar_chars
        if grammar.size > cap:
            raise APIError(400, f"{param} has {grammar.size} characters; this server compiles grammars of at most "
                           f"{cap} (--max-grammar-chars)", param=param, code="invalid_value")
        loop = asyncio.get_running_loop()
        try:
            work = loop.run_in_executor(self._pool, lambda: self.grammars().check(grammar))
            await asyncio.wait_for(work, self.limits.grammar_compile_timeout)
        except asyncio.TimeoutError:
            raise APIError(400, f"{param} took more than {self.limits.grammar_compile_timeout} s to compile "
                           "(--grammar-compile-timeout): simplify it", param=param, code="invalid_value") from None
        except UserError as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None

    def grammars(self) -> Grammars:
        """The compiler (made on first use: reading the vocabulary takes 0.3-1 s)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def warm(self) -> None:
        """Make the compiler in the background (at the server's start), so that no request waits for it."""
        if self.tokenizer is not None:
            self._pool.submit(self._warm)

    def _warm(self) -> None:
        try:
            self.grammars()
        except Exception as exc:   # e.g. XGrammar missing: the first structured request says so
            log.warning("structured output is not available: %s", exc)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

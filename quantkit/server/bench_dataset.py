"""Prompts for `quantkit bench serve`: random text of a given token length, or a JSONL file.

Random prompts are words drawn from a list of common English words, each one token in the usual
Llama/GPT-style vocabularies (after a space). Without a tokenizer the word count is fitted to the
server's own `usage.prompt_tokens` (see bench_serve.fit_words); with `--tokenizer DIR` the text is
cut to an exact token count. Every prompt differs from its first words on, so a server's prefix
cache cannot turn the benchmark into a cache benchmark.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from quantkit.config import UserError

WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air well also play "
    "small end put home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn plant cover food sun "
    "four between state keep eye never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem together next white children begin "
    "got walk example ease paper group always music those both mark often letter until mile river car feet care "
    "second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure "
    "watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon"
).split()


@dataclass(frozen=True)
class Prompt:
    """One request's input: a completion prompt or chat messages, and how many tokens to ask for."""

    output_len: int
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    input_len: Optional[int] = None      # exact token count of the text when a tokenizer made it


def random_words(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


def random_prompts(n: int, n_words: int, output_len: int, seed: int) -> list[Prompt]:
    """`n` prompts of `n_words` random words each (the caller fits `n_words` to a token count)."""
    rng = random.Random(seed)
    return [Prompt(output_len=output_len, prompt=random_words(n_words, rng)) for _ in range(n)]


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a local directory, with a one-line error when it cannot load."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise UserError(f"--tokenizer {path}: not a directory (give a local model or tokenizer folder)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a folder without tokenizer files
        raise UserError(f"--tokenizer {path}: cannot load a tokenizer ({type(exc).__name__}: {exc})") from None


def exact_prompts(tokenizer, n: int, n_tokens: int, output_len: int, seed: int) -> list[Prompt]:
    """`n` random-word prompts cut to `n_tokens` tokens of `tokenizer` (special tokens not counted).

    Decoding a cut token list and encoding it again can merge or split a token at the cut, so the
    cut is repeated until the text encodes to exactly `n_tokens` (a few rounds at most)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = random_words(n_tokens + 8, rng)
        ids = tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < n_tokens:  # words of several tokens only make it longer: this loop is rare
            text += " " + random_words(n_tokens, rng)
            ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(8):
            text = tokenizer.decode(ids[:n_tokens])
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n_tokens:
                break
        out.append(Prompt(output_len=output_len, prompt=text, input_len=len(ids)))
    return out


def load_jsonl(path: str | Path, default_output_len: int, endpoint: str) -> list[Prompt]:
    """Prompts from a JSONL file: one {"prompt": str} or {"messages": [{"role", "content"}, ...]} object
    a line, with an optional positive integer "output_len" (else `default_output_len`). Blank lines are
    skipped; anything else is refused with the line number."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--dataset {path}: no such file (use 'random' or a .jsonl file)")
    prompts = []
    for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p.name} line {no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected an object with 'prompt' or 'messages'")
        prompts.append(_prompt_from(obj, where, default_output_len, endpoint))
    if not prompts:
        raise UserError(f"--dataset {path}: no prompts in the file")
    return prompts


def _prompt_from(obj: dict, where: str, default_output_len: int, endpoint: str) -> Prompt:
    out_len = obj.get("output_len", default_output_len)
    if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
        raise UserError(f"{where}: 'output_len' must be a positive integer, got {out_len!r}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise UserError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise UserError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(output_len=out_len, prompt=obj["prompt"])
    messages = obj["messages"]
    if endpoint == "completions":
        raise UserError(f"{where}: 'messages' needs the chat endpoint (drop --endpoint completions)")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return Prompt(output_len=out_len, messages=messages)


def take(prompts: list[Prompt], n: int) -> list[Prompt]:
    """The first `n` prompts, going round the list again when it is shorter."""
    return [prompts[i % len(prompts)] for i in range(n)]

"""`quantkit bench serve`: latency, throughput, TTFT and TPOT of any OpenAI-compatible server under load.

For each concurrency level C, C clients send their requests back to back (a closed loop: exactly C in
flight until the last requests drain) until the level's prompts are done; the level's duration runs
from the first request sent to the last answer. Columns (the seed's table):

- Latency/s: mean end-to-end latency of a completed request;
- Request, input-token and output-token throughput: completed requests, their prompt tokens and
  their output tokens, each divided by the level's duration;
- TTFT: time to the first chunk with text; TPOT: (latency − TTFT) / (output tokens − 1), per request;
  mean and 99th percentile over the completed requests, in ms.

Failed requests are counted per level with their messages; a level where all fail still has a row.
Before the sweep a few short probe requests check that the server answers, find the model name
when none is given, drop the length-forcing fields (`ignore_eos`, `min_tokens`) if the server refuses
them, and fit the random prompts' word count to `--input-len` with the server's own token counts.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from quantkit.config import UserError

try:
    import aiohttp
except ImportError:  # an optional dependency: the CLI prints this as one line
    raise UserError("quantkit bench serve needs aiohttp: pip install aiohttp") from None
from quantkit.server import bench_client as client
from quantkit.server.bench_dataset import WORDS, Prompt, exact_prompts, load_jsonl, load_tokenizer, random_prompts, take

DEFAULT_CONCURRENCY = (1, 4, 8, 16, 64, 128)
MAX_PROBES = 40  # requests of fit_words, at most


def default_num_prompts(concurrency: int) -> int:
    """Requests per level when --num-prompts is not given: 4 per client, at least 32, so that every
    client sends several requests and the ramp-up and drain are a small part of the level."""
    return max(4 * concurrency, 32)


def parse_levels(text: str) -> tuple[int, ...]:
    """'1,4,16' → (1, 4, 16)."""
    try:
        levels = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise UserError(f"--concurrency {text!r}: give comma-separated integers, e.g. 1,4,16,64") from None
    return levels


def parse_extra_body(text: Optional[str]) -> dict[str, Any]:
    """--extra-body: a JSON object, or {} when not given."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--extra-body: not JSON ({exc.msg})") from None
    if not isinstance(extra, dict):
        raise UserError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")
    return extra


@dataclass(frozen=True)
class BenchServeConfig:
    url: str
    model: Optional[str] = None              # None: the first id of GET /v1/models
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    num_prompts: Optional[int] = None        # per level; None: default_num_prompts(C)
    input_len: int = 512
    output_len: int = 128
    dataset: str = "random"                  # "random" or a .jsonl file
    tokenizer: Optional[str] = None          # a local folder: random prompts of exact token counts
    endpoint: str = "chat"                   # "chat" or "completions"
    timeout: float = 600.0                   # seconds per request
    api_key: Optional[str] = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    label: Optional[str] = None              # the run's name in tables and plots

    def check(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise UserError("--concurrency: give positive integers, e.g. 1,4,16,64")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserError("--num-prompts must be at least 1")
        if self.input_len < 1 or self.output_len < 1:
            raise UserError("--input-len and --output-len must be at least 1")
        if self.endpoint not in client.PATHS:
            raise UserError(f"--endpoint {self.endpoint!r}: use chat or completions")
        if self.timeout <= 0:
            raise UserError("--timeout must be positive (seconds)")
        if self.tokenizer and self.dataset != "random":
            raise UserError("--tokenizer sizes random prompts: it does not apply to a --dataset file")


@dataclass
class BenchRun:
    """One server's sweep: what was asked, what the probe found, one row per concurrency level."""

    label: str
    url: str
    model: str
    settings: dict[str, Any]
    notes: list[str]
    rows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(concurrency: int, results: list[client.RequestResult], duration: float,
              input_lens: list[Optional[int]]) -> dict[str, Any]:
    """One table row from a level's request results (`input_lens[i]`: prompt i's tokens when known
    without the server's usage)."""
    done = [(r, n) for r, n in zip(results, input_lens) if r.ok]
    ok = [r for r, _ in done]
    errors = Counter(r.error for r in results if not r.ok)
    row: dict[str, Any] = {"concurrency": concurrency, "requests": len(results), "completed": len(ok),
                           "failed": len(results) - len(ok), "duration_s": round(duration, 4),
                           "errors": dict(errors.most_common())}
    keys = ("latency_s", "request_throughput", "input_throughput", "output_throughput", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_input_tokens", "mean_output_tokens")
    row.update(dict.fromkeys(keys))
    row["output_tokens_from"] = _source({r.tokens_from for r in ok})
    prompt_tokens = [r.prompt_tokens if r.prompt_tokens is not None else n for r, n in done]
    row["input_tokens_from"] = (None if not ok else "usage" if all(r.prompt_tokens is not None for r in ok) else
                                "tokenizer" if all(p is not None for p in prompt_tokens) else "unknown")
    if not ok:
        return row
    out_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft * 1e3 for r in ok]
    tpots = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    known_inputs = [p for p in prompt_tokens if p is not None]
    row.update(latency_s=sum(r.latency for r in ok) / len(ok), request_throughput=len(ok) / duration,
               output_throughput=out_tokens / duration, mean_ttft_ms=sum(ttfts) / len(ttfts),
               p99_ttft_ms=_percentile(ttfts, 99), mean_output_tokens=out_tokens / len(ok))
    if len(known_inputs) == len(ok):
        row.update(input_throughput=sum(known_inputs) / duration, mean_input_tokens=sum(known_inputs) / len(ok))
    if tpots:
        row.update(mean_tpot_ms=sum(tpots) / len(tpots), p99_tpot_ms=_percentile(tpots, 99))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def _source(sources: set[str]) -> Optional[str]:
    return None if not sources else sources.pop() if len(sources) == 1 else "mixed"


class _Bench:
    """The state of one run: the session, the request URL and headers, the payload template."""

    def __init__(self, cfg: BenchServeConfig, session: aiohttp.ClientSession) -> None:
        self.cfg, self.session = cfg, session
        self.root = client.base_url(cfg.url)
        self.url = self.root + client.PATHS[cfg.endpoint]
        self.hdrs = client.headers(cfg.api_key)
        self.payload = client.Payload(model=cfg.model or "", endpoint=cfg.endpoint, ignore_eos=cfg.ignore_eos,
                                      extra=dict(cfg.extra_body))
        self.notes: list[str] = []

    async def send(self, prompt: Prompt, max_tokens: Optional[int] = None) -> client.RequestResult:
        return await client.send(self.session, self.url, self.payload.body(prompt, max_tokens), self.cfg.endpoint,
                                 self.cfg.timeout, self.hdrs)

    async def open_connections(self, n: int) -> None:
        """Leave `n` open connections in the session's pool (n GET /v1/models at once), so that a level's
        TTFTs do not include opening them (a new connection's first request can take tens of ms more)."""
        async def get() -> None:
            try:
                async with self.session.get(self.root + "/v1/models", headers=self.hdrs,
                                            timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # the level's requests will report what is wrong

        await asyncio.gather(*(get() for _ in range(n)))

    async def resolve_model(self) -> None:
        if self.payload.model:
            return
        try:
            ids = await client.list_models(self.session, self.root, self.hdrs, min(self.cfg.timeout, 30))
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
            raise UserError(f"cannot list the models of {self.root} ({exc or type(exc).__name__}): "
                            "is the server up? Or give --model") from None
        if not ids:
            raise UserError(f"{self.root}/v1/models lists no model: give --model")
        self.payload.model = ids[0]

    async def probe(self, prompt: Prompt) -> client.RequestResult:
        """One short request; drops the fields the server refuses. A probe that still fails is the
        user's problem to fix (wrong URL, model or key): one line, no sweep."""
        res = await self.send(prompt, max_tokens=2)
        if not res.ok and res.error.startswith(("HTTP 400", "HTTP 422")) and self.payload.ignore_eos:
            retry = replace(self.payload, ignore_eos=False)
            self.payload, first_error = retry, res.error
            res = await self.send(prompt, max_tokens=2)
            if res.ok:
                self.notes.append(f"the server refused ignore_eos/min_tokens ({first_error}): sent without them, "
                                  "so answers may end before --output-len (see mean_output_tokens)")
        if not res.ok and res.error.startswith(("HTTP 400", "HTTP 422")):
            self.payload = replace(self.payload, include_usage=False)
            res = await self.send(prompt, max_tokens=2)
            if res.ok:
                self.notes.append("the server refused stream_options: no usage counts asked for")
        if not res.ok:
            raise UserError(f"{self.url} (model {self.payload.model!r}): the first request failed: {res.error}")
        return res

    async def fit_words(self, input_len: int) -> int:
        """Words per random prompt so that the server counts `input_len` prompt tokens on average.

        Random prompts draw words uniformly from WORDS, so the mean tokens per word is that of the whole
        list: the list is sent in chunks (short requests, max_tokens 2) of about input_len / 3 tokens each
        (so that two joined fit where the benchmark's prompts fit; at most MAX_PROBES chunks), and the fixed
        part of a prompt (chat template, BOS) comes from the first two chunks alone and joined."""
        rng = random.Random(self.cfg.seed + 10_000)
        words = list(WORDS)
        rng.shuffle(words)

        async def count(ws: list[str]) -> Optional[int]:
            return (await self.probe(Prompt(output_len=2, prompt=" ".join(ws)))).prompt_tokens

        first = max(1, min(32, input_len // 8))
        rough = await count(words[:first])
        if rough is None:
            self.notes.append("the server reports no prompt_tokens: random prompts have --input-len words, "
                              "input token counts are unknown")
            return input_len
        size = max(1, min(64, round(input_len / 3 / (rough / first))), -(-len(words) // MAX_PROBES))
        chunks = [words[i:i + size] for i in range(0, len(words), size)]
        counts = [await count(chunks[0]), await count(chunks[1]), await count(chunks[0] + chunks[1])]
        fixed = counts[0] + counts[1] - counts[2]
        total = counts[0] + counts[1] - 2 * fixed + sum([await count(c) - fixed for c in chunks[2:]])
        return max(1, round((input_len - fixed) / (total / len(words))))

    async def fixed_tokens(self, tokenizer) -> int:
        """Prompt tokens the server adds around a text (chat template, BOS), from one probe."""
        p = exact_prompts(tokenizer, 1, 16, 2, self.cfg.seed + 10_000)[0]
        res = await self.probe(p)
        return 0 if res.prompt_tokens is None else max(0, res.prompt_tokens - p.input_len)


async def run_level(bench: _Bench, prompts: list[Prompt], concurrency: int, progress: bool) -> dict[str, Any]:
    """Send `prompts` with `concurrency` clients, each sending its next request when its last ends."""
    from tqdm.auto import tqdm

    results: list[Optional[client.RequestResult]] = [None] * len(prompts)
    queue = iter(range(len(prompts)))
    bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", unit="req", disable=not progress,
               dynamic_ncols=True)
    failed = 0

    async def worker() -> None:
        nonlocal failed
        for i in queue:  # one shared iterator: each index is taken by exactly one worker
            results[i] = await bench.send(prompts[i])
            failed += not results[i].ok
            bar.update(1)
            if failed:
                bar.set_postfix(failed=failed)

    clients = min(concurrency, len(prompts))
    await bench.open_connections(clients)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    duration = time.perf_counter() - start
    bar.close()
    row = summarize(concurrency, results, duration, [p.input_len for p in prompts])
    if len(prompts) < concurrency:
        bench.notes.append(f"concurrency {concurrency} had {len(prompts)} requests: at most {len(prompts)} in flight")
    return row


async def _run(cfg: BenchServeConfig, progress: bool) -> BenchRun:
    # The default connector allows 100 connections: a level of 128 would run at 100.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        bench = _Bench(cfg, session)
        await bench.resolve_model()
        levels = {c: cfg.num_prompts or default_num_prompts(c) for c in cfg.concurrency}
        if cfg.dataset != "random":
            pool = load_jsonl(cfg.dataset, cfg.output_len, cfg.endpoint)
            await bench.probe(pool[0])
            make = lambda n, seed: take(pool, n)  # noqa: E731
        elif cfg.tokenizer:
            tok = load_tokenizer(cfg.tokenizer)
            n_tokens = max(1, cfg.input_len - await bench.fixed_tokens(tok))
            make = lambda n, seed: exact_prompts(tok, n, n_tokens, cfg.output_len, seed)  # noqa: E731
        else:
            n_words = await bench.fit_words(cfg.input_len)
            make = lambda n, seed: random_prompts(n, n_words, cfg.output_len, seed)  # noqa: E731
        rows = []
        for i, (c, n) in enumerate(levels.items()):
            rows.append(await run_level(bench, make(n, cfg.seed + i), c, progress))
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("url", "model", "api_key", "label")}
    settings.update(num_prompts={str(c): n for c, n in levels.items()}, ignore_eos_sent=bench.payload.ignore_eos,
                    endpoint_path=client.PATHS[cfg.endpoint])
    return BenchRun(label=cfg.label or bench.payload.model, url=bench.root, model=bench.payload.model,
                    settings=settings, notes=bench.notes, rows=rows)


def bench_serve(cfg: BenchServeConfig, progress: bool = True) -> BenchRun:
    """Run the sweep of `cfg` against its server and return the table's rows (see the module doc)."""
    cfg.check()
    return asyncio.run(_run(cfg, progress))

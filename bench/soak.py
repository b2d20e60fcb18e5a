"""Soak a running OpenAI-compatible server: N minutes of mixed traffic, then whether it held up.

At a given concurrency; a table of what happened and of the targets (exit code 1 when one was missed,
so that it serves as a check), and the same as JSON with --output.

    python -m bench.soak --url http://127.0.0.1:23333 --minutes 10 --concurrency 64 --server-pid PID
    # the engine process SIGKILLed 2 and 6 minutes in; the server must answer again within 30 s each time:
    python -m bench.soak --url URL --server-pid PID --kill-engine-at 120,360 --output soak.json

Traffic (bench/lib/soak_requests.py; the same for a seed): valid requests of random lengths and sampling
settings on both endpoints, streamed or not; invalid ones (bad JSON, wrong types, out-of-range values,
huge ints, a wrong Content-Type, too-long prompts, an unknown model...), which must get 4xx; clients that
leave mid-stream or before the answer. The first min(60 s, 10 %) is a warm-up: the memory figures are
read with the server idle after it and again after the last request.

Outcomes: ok, ok-disconnected, expected-4xx (an invalid request refused), unexpected-4xx (a valid one
refused), invalid-accepted, 5xx-expected (a 5xx or error event while the engine was restarting after a
kill of ours: 503 with Retry-After, or a message naming the engine, from the kill until 5 s after the
server answered again), 5xx-unexpected, failed (no answer in --timeout, a dropped connection, a
truncated or malformed answer). Targets: no unexpected-4xx, invalid-accepted, 5xx-unexpected or failed;
0 KV blocks in use once idle; RSS drift (server + children) ≤ --max-rss-drift %; each kill recovered
within --max-recovery-s.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import psutil

from bench.lib.soak_client import Client, Result
from bench.lib.soak_report import Kill, SoakReport, summarize, table
from bench.lib.soak_requests import Traffic, text
from bench.lib.soak_server import engine_process, gpu_mib, metric, parse_metrics, rss_mib
from quantkit.config import UserError
from quantkit.server.bench_client import base_url, headers

BACKOFF_S = 0.2   # a client pauses this long after a server error or a failed connection, as real clients do


@dataclass(frozen=True)
class SoakConfig:
    url: str
    minutes: float = 10.0
    concurrency: int = 64
    seed: int = 0
    server_pid: Optional[int] = None          # the server's process: memory figures, the engine to kill
    kill_engine_at: tuple[float, ...] = ()    # seconds into the run
    model: Optional[str] = None               # None: the first of /v1/models
    max_prompt_tokens: int = 512
    max_output_tokens: int = 128
    max_rss_drift: float = 2.0                # percent
    max_recovery_s: float = 30.0
    recovery_wait_s: float = 120.0            # how long a kill waits for a 200 before calling it lost
    idle_wait_s: float = 60.0                 # how long the end waits for in-flight requests and blocks to be 0
    timeout: float = 300.0                    # seconds per request
    api_key: Optional[str] = None

    def check(self) -> None:
        if self.minutes <= 0 or self.concurrency < 1:
            raise UserError("--minutes must be positive and --concurrency at least 1")
        if self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise UserError("--max-prompt-tokens and --max-output-tokens must be at least 1")
        if self.kill_engine_at and self.server_pid is None:
            raise UserError("--kill-engine-at needs --server-pid PID (the `quantkit serve` process)")
        late = [t for t in self.kill_engine_at if not 0 <= t < self.minutes * 60]
        if late:
            raise UserError(f"--kill-engine-at {late[0]:g}: give seconds within the run (0 to {self.minutes * 60:g})")
        if self.server_pid is not None and not psutil.pid_exists(self.server_pid):
            raise UserError(f"--server-pid {self.server_pid}: no such process on this machine")


class Soak:
    """One run: the session, the client, the clock (seconds since the traffic started), the results."""

    def __init__(self, cfg: SoakConfig, session: aiohttp.ClientSession) -> None:
        self.cfg, self.session = cfg, session
        self.root, self.hdrs = base_url(cfg.url), headers(cfg.api_key)
        self.start = time.monotonic()
        self.client = Client(session, self.root, self.hdrs, cfg.timeout, self.clock)
        self.results: list[Result] = []
        self.counter = itertools.count()

    def clock(self) -> float:
        return time.monotonic() - self.start

    async def metrics(self) -> dict[str, float]:
        try:
            async with self.session.get(self.root + "/metrics", headers=self.hdrs,
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:
                return parse_metrics(await r.text()) if r.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return {}

    async def wait_idle(self) -> dict[str, float]:
        """/metrics once nothing is in flight and no KV block is held, or after --idle-wait seconds."""
        deadline = time.monotonic() + self.cfg.idle_wait_s
        while True:
            m = await self.metrics()
            busy = (metric(m, "quantkit_num_requests_in_flight") or 0) + (metric(m, "quantkit_kv_blocks_used") or 0)
            if not busy or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.2)

    async def plan(self) -> Traffic:
        """The model, the context, and the words per prompt that keep prompts under --max-prompt-tokens."""
        try:
            async with self.session.get(self.root + "/v1/models", headers=self.hdrs,
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                cards = (await r.json(content_type=None))["data"] if r.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as exc:
            raise UserError(f"{self.root}/v1/models did not answer ({type(exc).__name__}): is the server up?") from None
        model = self.cfg.model or next((c["id"] for c in cards), None)
        if model is None:
            raise UserError(f"{self.root}/v1/models lists no model (or refused the key): give --model / --api-key")
        max_model_len = next((c.get("max_model_len") for c in cards if c.get("id") == model), None)
        words = 16
        status, body = await self.client.probe({"model": model, "prompt": text(random.Random(0), words),
                                                 "max_tokens": 1}, timeout=60)
        if status != 200:
            raise UserError(f"{self.root}: a first short request to model {model!r} got {status or 'no answer'}: "
                            "check --model and --api-key")
        per_word = (body.get("usage") or {}).get("prompt_tokens", 2 * words) / words
        cap = self.cfg.max_prompt_tokens if max_model_len is None else min(self.cfg.max_prompt_tokens,
                                                                         max_model_len // 2)
        return Traffic(model, max_model_len, max(1, int(cap / per_word)), self.cfg.max_output_tokens, self.cfg.seed)

    async def traffic(self, plan: Traffic, until: float) -> None:
        """`concurrency` clients, each sending its next request when its last ended, until `until`."""
        async def client() -> None:
            while self.clock() < until:
                res = await self.client.send(plan.spec(next(self.counter)))
                self.results.append(res)
                if res.server_error or not (res.status or res.complete):
                    await asyncio.sleep(BACKOFF_S)

        await asyncio.gather(*(client() for _ in range(self.cfg.concurrency)))

    async def kills(self, model: str) -> list[Kill]:
        """SIGKILL the engine at each --kill-engine-at, then time until a normal request gets 200 again."""
        done = []
        probe = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        for at in self.cfg.kill_engine_at:
            await asyncio.sleep(max(0.0, at - self.clock()))
            proc = engine_process(self.cfg.server_pid)
            kill = Kill(at_s=round(self.clock(), 3))
            done.append(kill)
            if proc is None:
                kill.note = f"no engine process among the children of pid {self.cfg.server_pid}: nothing killed"
                continue
            kill.pid = proc.pid
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                kill.note = f"the engine process {proc.pid} ended before the kill"
            while self.clock() - kill.at_s < self.cfg.recovery_wait_s:
                status, _ = await self.client.probe(probe, timeout=10)
                if status == 200:
                    kill.recovery_s = round(self.clock() - kill.at_s, 3)
                    break
                await asyncio.sleep(0.2)
            else:
                kill.note = f"no 200 within {self.cfg.recovery_wait_s:g} s"
        return done

    def memory(self) -> tuple[Optional[float], Optional[float]]:
        """RSS and GPU MiB of the server and its children; None for what cannot be read."""
        pid = self.cfg.server_pid
        try:
            return (None, None) if pid is None else (rss_mib(pid), gpu_mib(pid))
        except psutil.NoSuchProcess:   # the server itself is gone
            return None, None


async def run(cfg: SoakConfig) -> SoakReport:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        soak = Soak(cfg, session)
        plan = await soak.plan()
        before = await soak.metrics()
        duration = cfg.minutes * 60
        soak.start = time.monotonic()
        killing = asyncio.ensure_future(soak.kills(plan.model)) if cfg.kill_engine_at else None
        await soak.traffic(plan, until=min(60.0, duration / 10))   # the warm-up
        await soak.wait_idle()
        rss0, gpu0 = soak.memory()
        await soak.traffic(plan, until=duration)
        elapsed = soak.clock()
        kills = await killing if killing else []
        after = await soak.wait_idle()
        rss1, gpu1 = soak.memory()
    settings = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    return summarize(settings, soak.results, kills, elapsed, before, after, (rss0, rss1), (gpu0, gpu1))


def soak(cfg: SoakConfig) -> SoakReport:
    """Run the soak of `cfg` against its server (see the module doc)."""
    cfg.check()
    return asyncio.run(run(cfg))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the running server, e.g. http://127.0.0.1:23333")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs (default 10)")
    ap.add_argument("--concurrency", type=int, default=64, help="clients, each with one request at a time (64)")
    ap.add_argument("--seed", type=int, default=0, help="the traffic's seed: the same seed sends the same requests")
    ap.add_argument("--server-pid", type=int, help="the server's process id (this machine): RSS and GPU memory of "
                    "it and its children, and the engine process for --kill-engine-at")
    ap.add_argument("--kill-engine-at", default="", metavar="S[,S...]", help="SIGKILL the engine process (the "
                    "server's multiprocessing child) at these seconds into the run, each after the server answered "
                    "again since the last; needs --server-pid")
    ap.add_argument("--model", help="the model to request (default: the first of /v1/models)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="longest valid prompt in tokens (default 512; at most half the server's context)")
    ap.add_argument("--max-output-tokens", type=int, default=128, help="largest max_tokens of a valid request (128)")
    ap.add_argument("--max-rss-drift", type=float, default=2.0, help="target: RSS drift at most this %% (2)")
    ap.add_argument("--max-recovery-s", type=float, default=30.0,
                    help="target: the server answers 200 again within this many seconds of a kill (30)")
    ap.add_argument("--recovery-wait", type=float, default=120.0, help="seconds to wait for that before giving up")
    ap.add_argument("--idle-wait", type=float, default=60.0,
                    help="seconds to wait, after the traffic, for in-flight requests and KV blocks to reach 0 (60)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take (300)")
    ap.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--output", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    try:
        kill_at = tuple(float(t) for t in args.kill_engine_at.split(",") if t.strip())
    except ValueError:
        ap.error(f"--kill-engine-at {args.kill_engine_at!r}: give seconds separated by commas, e.g. 120,360")
    cfg = SoakConfig(url=args.url, minutes=args.minutes, concurrency=args.concurrency, seed=args.seed,
                     server_pid=args.server_pid, kill_engine_at=kill_at, model=args.model,
                     max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                     max_rss_drift=args.max_rss_drift, max_recovery_s=args.max_recovery_s,
                     recovery_wait_s=args.recovery_wait, idle_wait_s=args.idle_wait, timeout=args.timeout,
                     api_key=args.api_key)
    try:
        rep = soak(cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(rep))
    if args.output:
        args.output.write_text(json.dumps(asdict(rep), indent=2) + "\n")
        print(f"wrote {args.output}")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())

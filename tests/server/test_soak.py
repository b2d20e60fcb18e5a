"""Soak: 500 streamed requests at concurrency 32, one client in five leaving mid-stream. No 5xx; every
request completes or is aborted; the KV blocks in use return to 0; the server's RSS grows < 5 % between
the first hundred requests and the last (the server and its engine process together)."""

from __future__ import annotations

import asyncio
import time

import psutil

from quantkit_testing.serve_process import wait_idle

TOTAL, CONCURRENCY, LEAVE_EVERY = 500, 32, 5
FULL_TOKENS, LEAVER_TOKENS = 6, 40
DEADLINE_S = 300


def rss_total(proc: psutil.Process) -> int:
    return sum(p.memory_info().rss for p in (proc, *proc.children(recursive=True)))


def test_soak(qk_server):
    import aiohttp

    url = qk_server.url + "/v1/chat/completions"
    server = psutil.Process(qk_server.pid)
    before = wait_idle(qk_server.url)
    statuses: list[int] = []
    outcomes: list[str] = []
    rss: dict[str, int] = {}
    done = 0
    start = time.monotonic()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        leaves = i % LEAVE_EVERY == LEAVE_EVERY - 1
        body = {"messages": [{"role": "user", "content": f"request {i}: the cache keeps keys"}], "stream": True,
                "max_tokens": LEAVER_TOKENS if leaves else FULL_TOKENS, "ignore_eos": True, "seed": i}
        async with session.post(url, json=body) as resp:
            statuses.append(resp.status)
            if resp.status != 200:
                outcomes.append(f"status {resp.status}")
            elif leaves:
                reads = 0
                async for _ in resp.content.iter_any():
                    reads += 1
                    if reads == 2:
                        break
                resp.close()                          # drop the connection mid-stream
                outcomes.append("left")
            else:
                data = await resp.read()
                outcomes.append("done" if data.endswith(b"data: [DONE]\n\n") else "truncated")
        done += 1
        if done == 100:
            rss["first"] = rss_total(server)

    async def run() -> None:
        sem = asyncio.Semaphore(CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as s:
            async def guarded(i: int) -> None:
                async with sem:
                    assert time.monotonic() - start < DEADLINE_S
                    await one(s, i)
            await asyncio.wait_for(asyncio.gather(*(guarded(i) for i in range(TOTAL))), DEADLINE_S)

    asyncio.run(run())
    rss["last"] = rss_total(server)
    elapsed = time.monotonic() - start
    assert len(statuses) == TOTAL and all(s == 200 for s in statuses), sorted(set(statuses))
    leavers = TOTAL // LEAVE_EVERY
    assert outcomes.count("done") == TOTAL - leavers and outcomes.count("left") == leavers, set(outcomes)

    after = wait_idle(qk_server.url)
    assert after["quantkit_kv_blocks_used"] == 0 and after["quantkit_num_requests_in_flight"] == 0
    assert after["quantkit_num_requests_running"] == 0 and after["quantkit_num_requests_waiting"] == 0

    def delta(reason: str) -> float:
        key = f'quantkit_requests_total{{endpoint="chat",finish_reason="{reason}"}}'
        return after.get(key, 0) - before.get(key, 0)

    # Each request finished ("length": it asked ignore_eos) or was aborted when its client left.
    assert delta("length") + delta("abort") == TOTAL and delta("length") >= TOTAL - leavers
    assert delta("abort") >= leavers * 0.9
    growth = rss["last"] / rss["first"] - 1
    assert growth < 0.05, f"RSS {rss['first'] / 2**20:.1f} → {rss['last'] / 2**20:.1f} MiB"
    print(f"soak: {TOTAL} requests in {elapsed:.1f} s, RSS growth {growth * 100:+.2f} %")

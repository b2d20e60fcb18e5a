"""EngineLoop over a scripted engine: requests batched into shared steps run back to back, aborts reach the
engine between steps, a refused request and a failing step become EngineFailures for their requests (a
failing step also gives up: the server exits);
and the random-weight models `quantkit serve random:SHAPE:WEIGHTS` builds, with their byte tokenizer."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import torch

from quantkit.config import UserError
from quantkit.engine.llm_engine import RequestOutput, Usage
from quantkit.server.engine_loop import EngineLoop
from quantkit.server.engine_requests import EngineFailure


class ScriptedEngine:
    """Each request asks for `params` tokens; every step gives each unfinished request one."""

    tokenizer = generation_config = None
    scheduler = SimpleNamespace(max_model_len=100)
    config = SimpleNamespace(max_num_seqs=8, block_size=16)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=32))
    block_manager = SimpleNamespace(num_blocks=4)

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.steps = 0
        self.batch_sizes: list[int] = []
        self.fail = False

    def add_request(self, token_ids, params, request_id):
        if not token_ids:
            raise UserError("the prompt is empty")
        self.left[request_id] = params

    def abort(self, request_id):
        self.left.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.left)

    def stats(self):
        return {"running": len(self.left)}

    def step(self):
        if self.fail:
            raise RuntimeError("device lost")
        self.steps += 1
        self.batch_sizes.append(len(self.left))
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(RequestOutput(rid, "x", [7], done, "length" if done else None, Usage(1, 1)))
        return outs


async def _collect(queue: asyncio.Queue, timeout: float = 10.0) -> list:
    got = []
    while not got or not got[-1].finished:
        got.append(await asyncio.wait_for(queue.get(), timeout))
    return got


def test_requests_share_steps_that_run_back_to_back():
    engine = ScriptedEngine()

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        queues = [asyncio.Queue() for _ in range(3)]
        for i, q in enumerate(queues):
            loop.add(f"r{i}", [1, 2], 20, q.put_nowait)
        start = time.perf_counter()
        results = await asyncio.gather(*(_collect(q) for q in queues))
        elapsed = time.perf_counter() - start
        assert loop.num_in_flight == 0
        await loop.stop()
        return results, elapsed

    results, elapsed = asyncio.run(run())
    assert [len(r) for r in results] == [20, 20, 20] and all(r[-1].finish_reason == "length" for r in results)
    # Added together, the three ride the same 20 steps (the first step may have taken one or two).
    assert 20 <= engine.steps <= 22 and max(engine.batch_sizes) == 3
    assert elapsed < 5


def test_abort_reaches_the_engine_and_failures_reach_the_requests():
    engine = ScriptedEngine()

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        long_q: asyncio.Queue = asyncio.Queue()
        loop.add("long", [1], 10**9, long_q.put_nowait)
        await asyncio.wait_for(long_q.get(), 10)
        loop.abort("long")
        for _ in range(100):                      # bounded wait for the engine thread to apply it
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished_requests() and loop.num_in_flight == 0
        refused: asyncio.Queue = asyncio.Queue()
        loop.add("empty", [], 3, refused.put_nowait)
        failure = await asyncio.wait_for(refused.get(), 10)
        assert isinstance(failure, EngineFailure) and failure.user_error and "empty" in failure.message
        assert loop.alive
        engine.fail = True
        fatal: list[str] = []
        loop.on_fatal = fatal.append
        broken: asyncio.Queue = asyncio.Queue()
        loop.add("doomed", [1], 3, broken.put_nowait)
        failure = await asyncio.wait_for(broken.get(), 10)
        assert isinstance(failure, EngineFailure) and not failure.user_error and "device lost" in failure.message
        # A thread cannot be isolated: a failed step ends the loop and tells the server to exit.
        assert not loop.alive and "device lost" in loop.error and fatal and "device lost" in fatal[0]
        later: asyncio.Queue = asyncio.Queue()   # once failed, the engine is not stepped again
        loop.add("later", [1], 3, later.put_nowait)
        assert "not running" in (await asyncio.wait_for(later.get(), 10)).message
        await loop.stop()

    asyncio.run(run())


def test_concurrent_requests_on_the_engine_get_the_greedy_tokens_of_each_alone(tiny_models):
    from quantkit.engine import Engine, EngineConfig, SamplingParams

    eng = Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=2048))
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 15, 3)]
    # Engine.generate of one prompt: transformers' greedy tokens (tests/engine/test_engine.py checks it)
    alone = [eng.generate([p], greedy, progress=False)[0].token_ids for p in prompts]

    async def run():
        loop = EngineLoop(eng)
        loop.start()
        queues = [asyncio.Queue() for _ in prompts]
        for i, (p, q) in enumerate(zip(prompts, queues)):
            loop.add(f"r{i}", p, greedy, q.put_nowait)
        results = await asyncio.gather(*(_collect(q, 60) for q in queues))
        await loop.stop()
        return results

    results = asyncio.run(run())
    assert [[t for out in r for t in out.token_ids] for r in results] == alone
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_failed_forward_reaches_every_request_in_flight(tiny_models):
    from quantkit.engine import Engine, EngineConfig, SamplingParams

    eng = Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=1024))

    def broken_run(batch, previous=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng.runner.run = broken_run

    async def run():
        loop = EngineLoop(eng)
        fatal: list[str] = []
        loop.on_fatal = fatal.append
        loop.start()
        queues = [asyncio.Queue() for _ in range(3)]
        for i, q in enumerate(queues):
            loop.add(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=8), q.put_nowait)
        failures = await asyncio.gather(*(asyncio.wait_for(q.get(), 60) for q in queues))
        await loop.stop()
        return failures, fatal

    failures, fatal = asyncio.run(run())
    assert all(isinstance(f, EngineFailure) and "illegal memory access" in f.message for f in failures), failures
    assert fatal and "illegal memory access" in fatal[0]


def test_random_model_with_byte_tokenizer():
    from quantkit.engine import EngineConfig, SamplingParams
    from quantkit.server.model_source import byte_tokenizer, load_engine

    tok = byte_tokenizer(512)
    text = "héllo, the cache"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.decode([300, 2, 301], skip_special_tokens=True) == " w300 w301"
    with pytest.raises(UserError):
        byte_tokenizer(100)
    engine = load_engine("random:tiny:w4", EngineConfig(device="cpu", num_kv_tokens=512))
    assert engine.tokenizer.eos_token_id == 2 and len(engine.tokenizer) == engine.model.config.vocab_size
    out = engine.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=5, temperature=0,
                                                                             ignore_eos=True), progress=False)[0]
    assert len(out.token_ids) == 5 and out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_app_over_an_engine_thread(chat_model_dir):
    """The app over an in-process Engine (quantkit serve --engine-thread): served by uvicorn in a thread
    of this process; a streamed and a whole answer agree, a client leaving frees its blocks."""
    import socket
    import threading

    import requests
    import uvicorn

    from quantkit.engine import Engine, EngineConfig
    from quantkit.server.app import AppSettings, create_app

    engine = Engine(chat_model_dir, EngineConfig(device="cpu", num_kv_tokens=1024))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, AppSettings(served_model_name="m")),
                                           log_level="warning", lifespan="on"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        body = {"model": "m", "messages": [{"role": "user", "content": "the cache"}], "max_tokens": 8, "seed": 4,
                "ignore_eos": True}
        whole = requests.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        r = requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
            whole["choices"][0]["message"]["content"]
        leaving = requests.post(url + "/v1/chat/completions", stream=True, timeout=60,
                                json={**body, "max_tokens": 200, "stream": True})
        data_lines = (line for line in leaving.iter_lines() if line.startswith(b"data: "))
        next(data_lines), next(data_lines)       # the role chunk, then a token: the request holds blocks
        assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
        leaving.close()
        for _ in range(200):
            if engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
                break
            time.sleep(0.05)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.has_unfinished_requests()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_request_that_breaks_add_is_answered_alone():
    """Anything raised while a request is added (not only UserError) rejects that request with a 500-kind
    failure; the loop goes on serving the others."""
    engine = ScriptedEngine()
    add = engine.add_request

    def add_or_break(token_ids, params, request_id):
        if token_ids == [666]:
            raise MemoryError("decompression bomb")
        add(token_ids, params, request_id)

    engine.add_request = add_or_break

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        bad: asyncio.Queue = asyncio.Queue()
        good: asyncio.Queue = asyncio.Queue()
        loop.add("bad", [666], 3, bad.put_nowait)
        loop.add("good", [1], 3, good.put_nowait)
        failure = await asyncio.wait_for(bad.get(), 10)
        outs = await _collect(good)
        assert isinstance(failure, EngineFailure) and failure.status == 500 and "MemoryError" in failure.message
        assert len(outs) == 3 and outs[-1].finish_reason == "length" and loop.alive
        await loop.stop()

    asyncio.run(run())

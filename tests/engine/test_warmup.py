"""The start-up warm-up traffic (engine/warmup.py) meets the steps a serving engine meets — prefills beside every
decode count up to its width, a chunked prompt, a prefix hit, greedy and sampled rows — and leaves nothing behind:
no request, no block held, no prefix-cache key, zeroed counters; the engine then answers as a fresh one. Also the
start-up's helpers: the kernel-compilation watch and the compile-cache folder."""

from __future__ import annotations

import logging
import os

import pytest

from quantkit.config import UserError
from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.warmup import PROMPT_LENGTHS, traffic, warm_up
from quantkit.kernels import compile_cache
from quantkit.kernels.compile_watch import CompileWatch

from tests.engine.test_engine import GREEDY, hf_greedy, prompts


def test_traffic_fits_the_pool_and_the_context():
    plan = traffic(max_num_seqs=256, budget=64, max_model_len=1200, pool_tokens=12000, width=20)
    assert len(plan) == 23                      # 21 ramp requests, then a chunked prompt sent twice
    assert plan[-1] == plan[-2] and plan[-1][0] > 64
    assert all(n + new < 1200 for n, new in plan)
    assert sum(n + new for n, new in plan) <= 6000
    # Request i decodes while the later ones are prefilled, 44 prompt tokens a step beside 20 decodes.
    steps = [-(-n // 44) for n, _ in plan[:21]]
    assert [new for _, new in plan[:21]] == [sum(steps[i + 1:]) + 2 for i in range(21)]
    assert {n for n, _ in plan[:21]} == set(PROMPT_LENGTHS)
    small = traffic(max_num_seqs=4, budget=64, max_model_len=100, pool_tokens=64, width=20)
    assert len(small) <= 4 and sum(n + new for n, new in small) <= 32
    assert all(n + new < 100 for n, new in small)


def test_warm_up_meets_mixed_steps_and_leaves_nothing(tiny_models):
    path = tiny_models["llama"]
    eng = Engine(path, EngineConfig(device="cpu", num_kv_tokens=4096, max_num_batched_tokens=96,
                                    async_scheduling=True))
    mixed, chunked_from = set(), []
    schedule = eng.scheduler.schedule

    def recording():
        batch = schedule()
        decodes = sum(1 for _, n in batch if n == 1)
        if any(n > 1 for _, n in batch):
            mixed.add(decodes)
        chunked_from.extend(s.num_computed_tokens for s, n in batch if n > 1 and s.num_computed_tokens)
        return batch

    eng.scheduler.schedule = recording
    report = warm_up(eng, width=12)
    assert report.requests == 15 and report.steps > 12
    assert set(range(1, 12)) <= mixed           # a prefill beside 1, 2, … 11 decodes (the 13th prompt is 1 token)
    assert chunked_from                         # prompt tokens after cached ones: a later chunk, a prefix hit
    assert not eng.has_unfinished_requests() and eng._inflight is None
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.key_to_block
    assert all(b.key is None for b in bm.blocks)
    stats = eng.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"], stats["preemptions"]) == (0, 0, 0)
    eng.scheduler.schedule = schedule
    ps = prompts(1, (5, 37))
    assert [o.token_ids for o in eng.generate(ps, GREEDY, progress=False)] == [hf_greedy(path, p) for p in ps]


def test_warm_up_refuses_a_busy_engine(tiny_models):
    eng = Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=512))
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(eng)


def test_engine_config_warms_up_at_start(tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="quantkit.engine"):
        eng = Engine(tiny_models["qwen2"], EngineConfig(device="cpu", num_kv_tokens=2048, warmup=True))
    text = caplog.text
    for phase in ("weights loaded", "KV pool", "warm-up traffic", "ready in"):
        assert f"start: {phase}" in text
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks and not eng._requests


def test_compile_watch_counts_new_specializations_met_after_start(caplog, monkeypatch):
    """KeptKernel reports each compiled kernel the front end returns for the first time; after the engine is
    ready such a first sight is counted and logged with the kernel's name."""
    from quantkit.kernels import launch

    class Compiled:  # what Triton's front end returns: one object per specialization
        run = function = packed_metadata = None

    specializations: dict = {}

    class Front:  # a kernel whose front end specializes on its first argument's value
        __name__ = "decode_kernel"

        def __getitem__(self, grid):
            return lambda *args, **options: specializations.setdefault(args[0], Compiled())

    watch = CompileWatch()
    monkeypatch.setattr(launch, "COMPILES", watch)
    monkeypatch.setattr(launch, "hooks_set", lambda: True)   # every launch through the front end
    kernel = launch.KeptKernel(Front())
    kernel((1,), (7,))
    kernel((1,), (7,))
    assert (watch.total, watch.after_start) == (1, 0)
    watch.mark_started()
    with caplog.at_level(logging.WARNING, logger="quantkit.kernels.compile_watch"):
        kernel((1,), (7,))
        kernel((1,), (8,))
    assert (watch.total, watch.after_start) == (2, 1) and watch.names["decode_kernel"] == 2
    assert "decode_kernel met a new specialization after start" in caplog.text


def test_cache_dir_holds_tritons_and_inductors_caches(tmp_path, monkeypatch):
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", compile_cache.ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_cache_dir() == tmp_path / "xdg" / "quantkit"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.use_cache_dir() == tmp_path / "env"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "env" / "triton")
    chosen = compile_cache.use_cache_dir(tmp_path / "chosen")   # --cache-dir wins over what is set
    assert os.environ["TRITON_CACHE_DIR"] == str(chosen / "triton") and (chosen / "inductor").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot write there"):
        compile_cache.use_cache_dir(blocker / "cache")

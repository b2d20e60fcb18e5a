"""Centred, Hadamard-rotated keys in the KV pool (kernels/kv_rotation.py) inside Attention: outputs
unchanged at KV16, in prefill and decode, and the decoder still equals transformers; at KV4, keys with
outlier channels (what per-token int4 codes handle worst) lose much less through a rotated pool, and
less again with their centres subtracted."""

from __future__ import annotations

import math

import pytest
import torch

from quantkit_testing.decoder_check import assert_same_logits, engine_logits, hf_logits, hf_model, make_prompts
from quantkit.engine.attention import Attention, AttnMetadata
from quantkit.engine.model import load_decoder
from quantkit.kernels.paged_kv import PagedKV

HEADS, KV_HEADS, D, T = 4, 2, 64, 48


def attend(bits, rotation, q, k, v, decode_last=False, center=None):
    """Attention's output for one sequence of T tokens through a fresh pool: one prefill of all T, or
    (`decode_last`) a prefill of T − 1 then the last token as a decode step. `center`: the key centres."""
    attn = Attention(HEADS, KV_HEADS, D, D ** -0.5)
    attn.k_center = center
    blocks = math.ceil(T / 16)
    attn.kv_cache = PagedKV.allocate(blocks, 16, KV_HEADS, D, bits, q.dtype, "cpu", rotation=rotation)
    tables = torch.arange(blocks, dtype=torch.int32)[None]

    def step(start, end, decode):
        meta = AttnMetadata(slot_mapping=torch.arange(start, end), block_tables=tables,
                            context_lens=torch.tensor([end], dtype=torch.int32),
                            query_start=torch.tensor([0, end - start], dtype=torch.int32), is_decode=decode,
                            host_lens=([0, end - start], [end]))
        return attn(q[start:end], k[start:end], v[start:end], meta)

    if not decode_last:
        return step(0, T, False)
    return torch.cat([step(0, T - 1, False), step(T - 1, T, True)])


def attention64(q, k, v):
    """Causal softmax(q kᵀ / √D) v in float64 (GQA by repetition)."""
    k, v = (x.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * D ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def centres(k):
    """The key centres engine/kv_scales.key_centers takes from calibration: each channel's mean."""
    return k.mean(0)


def qkv(seed, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    if outliers:  # two channels far larger than the rest, offset from 0, in every key (as after RoPE in real models)
        k[..., [5, 40]] = k[..., [5, 40]] * 6 + 20
    return q, k, v


@pytest.mark.parametrize("decode_last", [False, True])
def test_rotation_leaves_an_unquantized_pool_unchanged(decode_last):
    q, k, v = qkv(0, outliers=True)
    plain = attend(16, "none", q, k, v, decode_last)
    rotated = attend(16, "hadamard", q, k, v, decode_last)
    centred = attend(16, "hadamard", q, k, v, decode_last, center=centres(k))
    for out in (rotated, centred):
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.double(), attention64(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotation_cuts_int4_error_of_keys_with_outlier_channels(seed):
    q, k, v = qkv(seed, outliers=True)
    want = attention64(q, k, v)

    def error(rotation, center=None):
        out = attend(4, rotation, q, k, v, decode_last=True, center=center)
        return ((out.double() - want).norm() / want.norm()).item()

    plain, rotated, centred = error("none"), error("hadamard"), error("hadamard", centres(k))
    assert rotated < 0.7 * plain and centred < 0.8 * rotated, (plain, rotated, centred)


def test_decoder_with_a_rotated_kv16_pool_equals_transformers(tiny_models):
    """Logits of a packed prefill and decode steps within 1e-4 of transformers', so greedy tokens agree."""
    model, _, _ = load_decoder(tiny_models["llama"], "cpu", torch.float32)
    hf = hf_model(tiny_models["llama"])
    assert_same_logits(model, hf, rotation="hadamard")
    prompts, decode = make_prompts()
    with torch.no_grad():
        rotated, want = engine_logits(model, prompts, decode, "hadamard"), hf_logits(hf, prompts, decode)
    for r_seq, w_seq in zip(rotated, want):
        assert all(torch.equal(r.argmax(-1), w.argmax(-1)) for r, w in zip(r_seq, w_seq))


class EagerGraph:
    """A CUDA graph's stand-in on the CPU: replay reruns the captured forward into its output buffer."""

    replays = 0

    def __init__(self, forward) -> None:
        self.forward, self.out = forward, forward()

    def replay(self) -> None:
        self.out.copy_(self.forward())
        EagerGraph.replays += 1


def test_graph_replays_read_a_rotated_pool_as_eager_steps_do(tiny_models):
    """Decode graphs and piecewise prefill graphs (eager stand-ins: they read and write only the runner's
    static buffers) over a KV4 pool, rotated by default, give the eager engine's greedy tokens."""
    from quantkit.engine import Engine, EngineConfig, SamplingParams

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 37, 19)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    pieces = []

    def piece_replay(piece):
        return lambda: pieces.append(1) or piece()

    def tokens(graphs: bool) -> list[list[int]]:
        eng = Engine(tiny_models["qwen2"], EngineConfig(device="cpu", kv_bits=4, num_kv_tokens=512, max_num_seqs=4,
                                                        max_num_batched_tokens=64, graph_max_tokens=64))
        assert eng.runner.kv_caches[0].rotation is not None
        if graphs:
            eng.runner.capture_graphs(lambda forward, meta: (lambda graph: (graph, graph.out))(EagerGraph(forward)))
            eng.runner.capture_piecewise(piece_replay)
        return [out.token_ids for out in eng.generate(prompts, greedy, progress=False)]

    assert tokens(graphs=True) == tokens(graphs=False)
    assert EagerGraph.replays >= 5 and pieces  # decode steps replayed graphs, prefills ran as pieces


@pytest.mark.parametrize("setting, bits, rotated", [("auto", 4, True), ("none", 4, False), ("hadamard", 8, True),
                                                    ("auto", 8, False)])
def test_the_runner_gives_its_pools_the_configured_rotation(tiny_models, setting, bits, rotated):
    """`--kv-rotation` reaches every layer's pool (auto: rotated at 4 bits only); `none` at 4 bits stores
    lmdeploy's plain codes, which code the same keys differently from the rotated pool."""
    from quantkit.eval.engine_perplexity import engine_runner, window_logits

    model, _, _ = load_decoder(tiny_models["llama"], "cpu", torch.float32)
    runner = engine_runner(model, bits, 64, kv_rotation=setting)
    assert all((pool.rotation is not None) == rotated for pool in runner.kv_caches)
    if setting == "none":
        window = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(0))
        plain = window_logits(runner, window)
        other = window_logits(engine_runner(model, bits, 64, kv_rotation="auto"), window)
        assert not torch.equal(plain, other)

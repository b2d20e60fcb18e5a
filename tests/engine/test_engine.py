"""Engine greedy tokens = transformers' greedy `generate`, with requests batched together, arriving at
different steps, chunked, preempted for lack of blocks, and reusing cached prefixes."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import UserError
from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.model_runner import graph_buckets

NEW = 32
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def prompts(seed: int, lengths=(5, 37, 2, 19, 64)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


_HF: dict = {}


def hf_greedy(path, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation (EOS ignored), one prompt at a time: the oracle."""
    from transformers import AutoModelForCausalLM

    from transformers import GenerationConfig

    key = (str(path), tuple(prompt))
    if key not in _HF:
        model = _HF.setdefault(str(path), AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
        # No EOS at all (as ignore_eos): min_new_tokens would instead mask EOS out of the argmax.
        model.generation_config.eos_token_id = []
        config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=0)
        out = model.generate(torch.tensor([prompt]), generation_config=config)
        assert out.shape[1] == len(prompt) + NEW
        _HF[key] = out[0, len(prompt):].tolist()
    return _HF[key]


def engine(path, **settings) -> Engine:
    return Engine(path, EngineConfig(device="cpu", **{"num_kv_tokens": 2048, **settings}))


def run_staggered(eng: Engine, batches: list[list[list[int]]], steps_between: int = 3) -> dict[str, list[int]]:
    """Add each group of prompts `steps_between` steps after the previous one; step to the end."""
    ids, tokens, done = {}, {}, set()
    for group in batches:
        for p in group:
            rid = eng.add_request(p, GREEDY)
            ids[rid], tokens[rid] = p, []
        for _ in range(steps_between):
            for out in eng.step():
                tokens[out.request_id] += out.token_ids
                done |= {out.request_id} if out.finished else set()
    while len(done) < len(ids):
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
            done |= {out.request_id} if out.finished else set()
    return {rid: (ids[rid], tokens[rid]) for rid in ids}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_equals_hf_with_staggered_arrivals_and_chunked_prefill(tiny_models, arch):
    path = tiny_models[arch]
    ps = prompts(1)
    # A 24-token budget splits the longer prompts over several steps, beside other sequences' decodes.
    eng = engine(path, max_num_batched_tokens=24)
    results = run_staggered(eng, [ps[:2], ps[2:4], ps[4:]])
    assert len(results) == len(ps)
    for prompt, toks in results.values():
        assert toks == hf_greedy(path, prompt)
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks  # every block given back


def test_steps_carry_their_lengths_on_the_host(tiny_models):
    """Each step's metadata holds query_start and context_lens as host lists equal to its tensors (the
    prefill attention's loop bounds: no layer reads them back from the device), and a mixed step's
    prefill part holds its own, renumbered from its first sequence."""
    eng = engine(tiny_models["llama"], max_num_batched_tokens=24)
    prepare, mixed = eng.runner.prepare, []

    def checked(batch, previous=None):
        step = prepare(batch, previous)
        meta = step.meta
        assert meta.host_lens == (meta.query_start.tolist(), meta.context_lens.tolist())
        if meta.prefill is not None:
            _, lens, starts, host = meta.prefill
            assert host == (starts.tolist(), lens.tolist()) and host[0][0] == 0
            mixed.append(meta.num_decode)
        return step

    eng.runner.prepare = checked
    ps = prompts(1)
    results = run_staggered(eng, [ps[:2], ps[2:]])
    assert mixed and all(nd > 0 for nd in mixed)
    for prompt, toks in results.values():
        assert toks == hf_greedy(tiny_models["llama"], prompt)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_hf_under_preemption(tiny_models, arch):
    path = tiny_models[arch]
    ps = prompts(2, (20, 30, 12, 25))
    # 10 blocks of 16 = 160 tokens for four sequences that end at 44–62 tokens: some must be preempted.
    eng = engine(path, num_kv_tokens=160, enable_prefix_caching=False)
    outs = eng.generate(ps, GREEDY, progress=False)
    assert eng.scheduler.num_preemptions > 0
    for p, out in zip(ps, outs):
        assert out.token_ids == hf_greedy(path, p)
        assert out.finish_reason == "length" and out.usage.completion_tokens == NEW


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_hf_with_prefix_hits(tiny_models, arch):
    path = tiny_models[arch]
    shared = prompts(3, (40,))[0]
    tails = prompts(4, (3, 9, 1))
    eng = engine(path)
    first = eng.generate([shared + tails[0]], GREEDY, progress=False)[0]
    scheduled: list[tuple[int, int]] = []
    schedule = eng.scheduler.schedule

    def recording():
        batch = schedule()
        scheduled.extend((seq.num_computed_tokens, n) for seq, n in batch if seq.num_output_tokens == 0)
        return batch

    eng.scheduler.schedule = recording
    rest = eng.generate([shared + t for t in tails[1:]], GREEDY, progress=False)
    # Both later prompts start after the 2 full cached blocks (32 tokens) of the shared prefix.
    assert sorted(start for start, _ in scheduled) == [32, 32]
    for tail, out in zip(tails, [first, *rest]):
        assert out.token_ids == hf_greedy(path, shared + tail)


def test_stream_deltas_add_up_to_generate_and_close_aborts(tiny_models):
    eng = engine(tiny_models["llama"])
    prompt = "the model quantizes weights"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = eng.generate([prompt], params, progress=False)[0]
    deltas = list(eng.stream(prompt, params))
    assert "".join(d.text for d in deltas) == whole.text
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    stream = eng.stream(prompt, params)
    next(stream)
    assert eng.block_manager.num_free_blocks < eng.runner.num_blocks
    stream.close()  # the consumer stops early: the request is aborted and its blocks freed
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.has_unfinished()


def test_abort_frees_blocks_and_other_requests_go_on(tiny_models):
    path = tiny_models["llama"]
    eng = engine(path, enable_prefix_caching=False)
    ps = prompts(5, (10, 12))
    a = eng.add_request(ps[0], GREEDY)
    b = eng.add_request(ps[1], GREEDY)
    first = {out.request_id: out.token_ids for out in eng.step()}
    eng.abort(a)
    assert eng.scheduler.find(a) is None
    toks, finished = list(first[b]), None
    while finished is None:
        for out in eng.step():
            assert out.request_id == b
            toks += out.token_ids
            finished = out if out.finished else None
    assert toks == hf_greedy(path, ps[1])
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


def test_stop_string_and_chat_messages(tiny_models):
    eng = engine(tiny_models["llama"])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = eng.generate(["the cache keeps"], params, progress=False)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = eng.generate(["the cache keeps"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           stop=[stop]), progress=False)[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    # A tokenizer without a chat template gets the turns as 'role: content' lines.
    msgs = [{"role": "user", "content": "the model"}]
    by_messages = eng.generate([msgs], params, progress=False)[0]
    by_text = eng.generate(["user: the model\nassistant:"], params, progress=False)[0]
    assert by_messages.token_ids == by_text.token_ids


def test_user_errors(tiny_models):
    eng = engine(tiny_models["llama"], num_kv_tokens=64)
    with pytest.raises(UserError, match="prompt has 80 tokens"):
        eng.add_request(list(range(3, 83)), GREEDY)
    with pytest.raises(UserError, match="empty"):
        eng.add_request([], GREEDY)
    rid = eng.add_request([5, 6], GREEDY, request_id="x")
    with pytest.raises(UserError, match="already running"):
        eng.add_request([5, 6], GREEDY, request_id=rid)


class EagerReplay:
    """A CUDA graph's stand-in on the CPU: replay() reruns the captured forward on the same static
    tensors and writes into the same output tensor, so the runner's padding and copying are what is tested."""

    replays = 0

    def __init__(self, forward, meta) -> None:
        self.forward, self.meta = forward, meta
        self.out = forward()

    def replay(self) -> None:
        self.out.copy_(self.forward())  # the captured forward holds the graph's static metadata, `meta`
        EagerReplay.replays += 1


def test_decode_steps_through_graph_buckets_equal_hf(tiny_models):
    path = tiny_models["qwen2"]
    eng = engine(path, max_num_seqs=8)

    def capture(forward, meta):
        graph = EagerReplay(forward, meta)
        return graph, graph.out

    eng.runner.capture_graphs(capture)
    assert sorted(eng.runner.graphs) == [1, 2, 4, 8]
    assert graph_buckets(100)[-2:] == [64, 128] and graph_buckets(1000)[-1] == 512  # a bucket holds max_num_seqs
    ps = prompts(7, (9, 3, 30))  # 3 sequences: the bucket of 4 with one padding row (slot -1, writes nowhere)
    EagerReplay.replays = 0
    results = run_staggered(eng, [ps[:1], ps[1:]], steps_between=4)  # buckets 1, then 4 (and 2 as they end)
    assert EagerReplay.replays >= NEW
    for prompt, toks in results.values():
        assert toks == hf_greedy(path, prompt)


class CountingPieces:
    """Piecewise graphs' stand-in on the CPU: a piece runs eagerly when replayed (it reads and writes only
    the runner's static buffers, as a graph would); replays are counted."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, piece):
        def replay() -> None:
            self.replays += 1
            piece()
        return replay


@pytest.mark.parametrize("arch,budget", [("llama", 24), ("qwen2", 100), ("qwen3", 100), ("mistral", 300)])
def test_prefill_steps_through_piecewise_graphs_equal_hf(tiny_models, arch, budget):
    """Prefill and mixed steps padded to a bucket and run as pieces around eager attention give
    transformers' greedy tokens; every prompt token went through the pieces."""
    path = tiny_models[arch]
    eng = engine(path, max_num_batched_tokens=budget, graph_max_tokens=budget)
    counter = CountingPieces()
    eng.runner.capture_piecewise(counter)
    pieces = eng.runner.piecewise
    assert pieces.buckets[-1] >= budget and counter.replays == 0
    steps = []
    forward = pieces.forward
    pieces.forward = lambda ids, *a: steps.append(ids.shape[0]) or forward(ids, *a)
    ps = prompts(3, (5, 37, 2, 19, 64, 90))
    results = run_staggered(eng, [ps[:2], ps[2:4], ps[4:]])
    for prompt, toks in results.values():
        assert toks == hf_greedy(path, prompt)
    assert sum(steps) >= sum(len(p) for p in ps)  # prompt tokens, and the decodes of mixed steps
    assert counter.replays == len(steps) * (eng.model.num_layers + 1)
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


def test_piecewise_forward_equals_the_eager_forward(tiny_models):
    """A mixed step (two decodes, a prompt chunk after its cached first chunk), padded to its bucket: the
    real rows' hidden states equal the plain forward's, and the K/V written are the same (none for the
    padding rows)."""
    eng = engine(tiny_models["qwen2"], max_num_batched_tokens=60, graph_max_tokens=60)
    eng.runner.capture_piecewise(lambda piece: piece)
    for p in prompts(5, (7, 9)):
        eng.add_request(p, GREEDY)
    eng.step()  # both prompts: the next steps decode them
    eng.add_request(prompts(6, (100,))[0], GREEDY)
    eng.step()  # 2 decodes + the first 58 tokens of the long prompt
    batch = eng.scheduler.schedule()  # 2 decodes + its other 42 tokens: 44 rows in the bucket of 64
    step = eng.runner.prepare(batch)
    assert step.meta.num_decode == 2 and step.input_ids.shape[0] == 44
    caches = eng.runner.kv_caches
    before = [(c.k.clone(), c.v.clone()) for c in caches]
    plain = eng.model(step.input_ids, step.positions, step.meta)
    after = [(c.k.clone(), c.v.clone()) for c in caches]
    for c, (k, v) in zip(caches, before):
        c.k.copy_(k)
        c.v.copy_(v)
    pieces = eng.runner.piecewise
    assert pieces.bucket(44) == 64
    torch.testing.assert_close(pieces.forward(step.input_ids, step.positions, step.meta), plain,
                               rtol=1e-4, atol=1e-4)
    for c, (k, v) in zip(caches, after):
        torch.testing.assert_close(c.k, k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.v, v, rtol=1e-4, atol=1e-4)


def test_logprobs_come_with_the_tokens(tiny_models):
    eng = engine(tiny_models["llama"])
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    out = eng.generate([[5, 6, 7]], params, progress=False)[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:  # greedy: the chosen token is the most likely one
        assert lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1]) and len(lp.top) == 2
    streamed = list(eng.stream([5, 6, 7], params))
    assert [lp.token_id for o in streamed for lp in o.logprobs] == out.token_ids
    assert eng.generate([[5, 6, 7]], GREEDY, progress=False)[0].logprobs is None


def test_generate_ends_requests_aborted_from_elsewhere(tiny_models):
    eng = engine(tiny_models["llama"])
    step = eng.step
    calls = []

    def step_then_abort():
        outs = step()
        calls.append(1)
        if len(calls) == 2:
            eng.abort("1")  # as another thread (a server's disconnect) would, between two steps
        return outs

    eng.step = step_then_abort
    outs = eng.generate([[5, 6, 7], [8, 9]], GREEDY, progress=False)
    assert [o.finish_reason for o in outs] == ["length", "abort"]
    assert len(outs[0].token_ids) == NEW and len(outs[1].token_ids) == 2

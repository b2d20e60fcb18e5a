"""`quantkit chat`: the loop driven through a subprocess's stdin, the history's prefix-cache reuse, the
oldest turns dropped when the history outgrows the context, the sampling defaults, and Ctrl-C stopping
one answer (a real SIGINT) while the session goes on."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.chat import ChatSession, ContextFull, run_chat
from quantkit.engine.llm_engine import encode_chat

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SMALL_CONTEXT = 80


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=2048))


@pytest.fixture(scope="module")
def small_engine(tiny_models):
    return Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=1024, max_model_len=SMALL_CONTEXT))


@pytest.fixture
def sigint(request):
    """SIGINT as the test asks (`default_int_handler`, what an interactive Python has, unless the test is
    parametrized with another), whatever the shell that started pytest left (a background job ignores it)."""
    previous = signal.signal(signal.SIGINT, getattr(request, "param", signal.default_int_handler))
    yield
    signal.signal(signal.SIGINT, previous)


def test_cli_chat_through_stdin(tiny_models):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli", "chat", str(tiny_models["llama"]), "--device", "cpu",
         "--max-new-tokens", "5", "--temperature", "0", "--system", "be brief"],
        input="the model\n\nthe cache keeps\nclear\nthe model\nexit\nnever read\n",
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # The tiny model's generation_config sets no sampling: the flag, then chat's defaults.
    assert out.startswith("sampling: greedy; at most 5 new tokens (--temperature, else quantkit chat's defaults, "
                          "as the model sets none)\n"), out[:300]
    assert "'exit' leaves" in out and "(new conversation)" in out
    # Prompts: 3 messages + the empty line + clear + exit; nothing after exit is read.
    assert out.count(">>> ") == 6
    answers = [chunk.split("\n>>> ")[0] for chunk in out.split(">>> ")[1:]]
    # The same first message after `clear` gets the same greedy answer as at the start.
    assert answers[0] == answers[4] and answers[0].strip()


def test_history_reuses_the_cached_prefix(engine):
    session = ChatSession(engine, GREEDY, system="you answer about caches and models, in a few words")
    starts: list[int] = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        starts.extend(seq.num_computed_tokens for seq, n in batch if seq.num_output_tokens == 0)
        return batch

    engine.scheduler.schedule = recording
    try:
        written: list[str] = []
        first = session.answer("the model quantizes weights into groups of integers", written.append)
        assert "".join(written) == first
        session.answer("and the cache?", written.append)
    finally:
        engine.scheduler.schedule = schedule
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert starts[0] == 0 and starts[1] >= 16  # the second turn skipped the first turn's full blocks
    session.clear()
    assert session.messages == [{"role": "system", "content": session.system}]


def test_oldest_turns_are_dropped_when_the_history_outgrows_the_context(small_engine):
    engine = small_engine
    assert engine.scheduler.max_model_len == SMALL_CONTEXT
    session = ChatSession(engine, GREEDY, system="be brief")
    turns = [f"turn {i}: the model quantizes weights into groups of integers" for i in range(6)]
    sent: list[int] = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (sent.append(len(seq)), add(seq))[1]
    notes: list[str] = []
    try:
        for text in turns:
            written: list[str] = []
            answer = session.answer(text, written.append)
            assert answer and "".join(written).endswith(answer)
            notes += [w for w in written if w.startswith("(the conversation outgrew")]
    finally:
        engine.scheduler.add = add
    # Every prompt sent left room for the whole answer (6 tokens), so none stopped at the context.
    assert len(sent) == len(turns) and all(n + GREEDY.max_tokens <= SMALL_CONTEXT for n in sent)
    assert notes and all(n.endswith("dropped)\n") and f"context of {SMALL_CONTEXT} tokens" in n for n in notes)
    kept = session.messages
    assert kept[0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in kept[1:]] == ["user", "assistant"] * ((len(kept) - 1) // 2)
    users = [m["content"] for m in kept if m["role"] == "user"]
    assert 1 <= len(users) < len(turns) and users == turns[-len(users):]  # the newest turns, in order
    everything = [kept[0]] + [{"role": "user", "content": t} for t in turns]
    assert len(encode_chat(engine.tokenizer, everything)) > SMALL_CONTEXT  # the whole history could not fit
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_a_message_longer_than_the_context_fails_only_its_turn(small_engine):
    long = " ".join(["the model quantizes weights"] * 30)
    session = ChatSession(small_engine, GREEDY, system="be brief")
    session.answer("the cache", lambda s: None)
    before = list(session.messages)
    with pytest.raises(ContextFull, match=rf"this message does not fit the context of {SMALL_CONTEXT} tokens: the "
                                          r"prompt would be \d+ tokens with the system prompt, and 6 are kept"):
        session.answer(long, lambda s: None)
    assert session.messages == before  # nothing dropped, nothing added
    out, err = io.StringIO(), io.StringIO()
    run_chat(small_engine, GREEDY, stdin=io.StringIO(f"{long}\nthe cache\n"), stdout=out, stderr=err)
    assert err.getvalue().startswith("error: this message does not fit the context") and err.getvalue().count("\n") == 1
    answers = [chunk.split("\n>>> ")[0].strip() for chunk in out.getvalue().split(">>> ")[1:]]
    assert len(answers) == 3 and answers[0] == "" and answers[1]  # the next message is answered



def fake_engine(generation_config) -> SimpleNamespace:
    return SimpleNamespace(generation_config=generation_config, tokenizer=None)


def test_chat_samples_conservatively_when_the_model_sets_no_sampling():
    from transformers import GenerationConfig

    none = GenerationConfig(bos_token_id=1, eos_token_id=2)  # what the demo's SmolLM2 export carries
    session = ChatSession(fake_engine(none), SamplingParams(max_tokens=64))
    assert (session.resolved.temperature, session.resolved.top_p, session.resolved.top_k) == (0.7, 0.9, 0)
    assert session.sampling == ("sampling: temperature 0.7, top-p 0.9, top-k off; at most 64 new tokens "
                                "(quantkit chat's defaults, as the model sets none)")
    # The model's own settings when it has them; a missing file (None) is the same as none set.
    model = GenerationConfig(do_sample=True, temperature=0.6, top_k=20)
    own = ChatSession(fake_engine(model), SamplingParams(max_tokens=64)).resolved
    assert (own.temperature, own.top_p, own.top_k) == (0.6, 1.0, 20)
    assert ChatSession(fake_engine(None), SamplingParams()).resolved.temperature == 0.7
    greedy_model = ChatSession(fake_engine({"do_sample": False}), SamplingParams()).resolved
    assert greedy_model.temperature == 0
    # The user's flags over both.
    for gen in (none, model):
        flagged = ChatSession(fake_engine(gen), SamplingParams(temperature=1.2, top_p=0.5, top_k=5))
        assert (flagged.resolved.temperature, flagged.resolved.top_p, flagged.resolved.top_k) == (1.2, 0.5, 5)
        assert flagged.sampling.endswith("(--temperature --top-p --top-k)")
    mixed = ChatSession(fake_engine(none), SamplingParams(temperature=1.0)).resolved
    assert (mixed.temperature, mixed.top_p) == (1.0, 0.9)


def test_the_engine_samples_with_the_chat_defaults(engine):
    session = ChatSession(engine, SamplingParams(max_tokens=3))
    seen: list[SamplingParams] = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (seen.append(seq.params), add(seq))[1]
    try:
        session.answer("the model", lambda s: None)
    finally:
        engine.scheduler.add = add
    assert (seen[0].temperature, seen[0].top_p, seen[0].top_k) == (0.7, 0.9, 0)


@pytest.mark.parametrize("sigint", [signal.default_int_handler], indirect=True)
def test_ctrl_c_stops_the_answer_not_the_session(engine, sigint):
    session = ChatSession(engine, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    written: list[str] = []

    def write(text: str) -> None:
        written.append(text)
        if len(written) == 3:
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C sends; the session's handler takes it

    partial = session.answer("the model", write)
    assert written[-1] == " [stopped]"
    assert len(engine.tokenizer(partial, add_special_tokens=False)["input_ids"]) < 40
    assert not engine.has_unfinished_requests()  # the request was aborted, its blocks freed
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert session.messages[-1] == {"role": "assistant", "content": partial}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C at the prompt leaves again
    out = io.StringIO()
    run_chat(engine, GREEDY, stdin=io.StringIO("the cache\n"), stdout=out)  # end of input ends the loop
    assert out.getvalue().count(">>> ") == 2


@pytest.mark.parametrize("sigint", [signal.SIG_IGN], indirect=True)
def test_an_ignored_sigint_stays_ignored(engine, sigint):
    """Started as a background job (SIGINT ignored), the chat does not take SIGINT over."""
    session = ChatSession(engine, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    written: list[str] = []

    def write(text: str) -> None:
        written.append(text)
        if len(written) == 2:
            signal.raise_signal(signal.SIGINT)

    session.answer("the model", write)
    assert " [stopped]" not in written and len(written) == 8
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

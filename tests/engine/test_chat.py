"""`quantkit chat`: the loop driven through a subprocess's stdin, the history's prefix-cache reuse, and
Ctrl-C stopping one answer (a real SIGINT) while the session goes on."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.chat import ChatSession, run_chat

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=2048))


def test_cli_chat_through_stdin(tiny_models):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli", "chat", str(tiny_models["llama"]), "--device", "cpu",
         "--max-new-tokens", "5", "--temperature", "0", "--system", "be brief"],
        input="the model\n\nthe cache keeps\nclear\nthe model\nexit\nnever read\n",
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
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


def test_ctrl_c_stops_the_answer_not_the_session(engine):
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

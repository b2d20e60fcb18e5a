"""`quantkit serve` on exports of Qwen (v1), Baichuan2 and ChatGLM3 checkpoints in their original layouts
(issue #20): each tiny release (the writers of tests/models/test_<family>.py) quantized with RTN, its export
served by the real app over an in-thread engine, as `quantkit serve EXPORT --engine-thread` does (uvicorn
in a thread of this process, a free port on 127.0.0.1), and asked a system + two-turn chat, greedy, whole
and streamed. The answer is the engine's own greedy answer; the prompt the server counts is the family's
chat format built by hand (Qwen's ChatML through the tiktoken oracle, Baichuan2's build_chat_input,
ChatGLM3's build_chat_input); the engine stops at the family's end-of-turn tokens. What the engine process of
a plain `quantkit serve` sends back (tokenizer, generation config) survives the pipe for every family, and
the command itself, `quantkit serve EXPORT --port 0`, answers the same on the ChatGLM3 export."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

import quantkit
from quantkit.config import build_config
from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.llm_engine import encode_chat
from quantkit.server.protocol import ChatCompletionRequest
from quantkit.server.request_body import parse_request

TESTS = Path(__file__).resolve().parents[1]
SERVED = "family"
MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "上海是哪个国家的城市？"},
            {"role": "assistant", "content": "中国 the model"},
            {"role": "user", "content": "the cache keeps 2024 keys"}]
MAX_TOKENS = 12
REMOTE_PREFIXES = ("transformers_modules", "modeling_", "tokenization_qwen", "tokenization_baichuan",
                   "tokenization_chatglm", "configuration_")


def family_module(name: str):
    """tests/models/test_<name>.py imported by path under a private name (its writers and oracles; pytest
    does not collect it from here)."""
    key = "_families_test_" + name
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, TESTS / "models" / f"test_{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@dataclass
class Family:
    export: Path
    prompt_ids: Callable[[list[dict]], list[int]]   # the family's chat format, written by hand
    stop_ids: list[int]                              # generation_config.eos_token_id of the original release


def make_qwen(root: Path) -> tuple[Path, Callable, list[int]]:
    t = family_module("qwen")
    src, ranks = t.write_qwen_release(root / "Qwen-7B-Chat")
    # seq_length as long as the context (Qwen-7B-Chat's 8192 and 8192): ChatML's turns make even this short
    # chat longer than the test's 64, past which Qwen's own code would apply dynamic NTK (not reproduced).
    (src / "config.json").write_text(json.dumps({**t.CONFIG, "seq_length": t.CONFIG["max_position_embeddings"]}))
    n = len(ranks)   # <|endoftext|> n, <|im_start|> n + 1, <|im_end|> n + 2

    def chatml(messages):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return t.tiktoken_encode(text + "<|im_start|>assistant\n", ranks)

    return src, chatml, [n + 2, n]


def make_baichuan(root: Path) -> tuple[Path, Callable, list[int]]:
    import sentencepiece as spm

    t = family_module("baichuan")
    src, _, _ = t.write_baichuan_release(root / "Baichuan2-7B-Chat")
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    user, assistant = (sp.piece_to_id(p) for p in t.ROLE_PIECES)
    return src, lambda messages: t.build_chat_input(sp, messages, user, assistant), [2, user]


def make_chatglm3(root: Path) -> tuple[Path, Callable, list[int]]:
    import sentencepiece as spm
    from quantkit_testing.tiny import make_sentencepiece_tokenizer

    t = family_module("chatglm")
    make_sentencepiece_tokenizer(root / "sp", **t.NORMALIZER)
    sp = spm.SentencePieceProcessor(model_file=str(root / "sp" / "tokenizer.model"))
    src = t.write_release(root / "chatglm3-6b-32k", t.TINY_CHATGLM3, t.chatglm_tensors(t.TINY_CHATGLM3), root / "sp")
    ids = t.special_ids(sp)

    def build_chat_input(messages):
        return t.reference_chat_input(sp, messages[:-1], messages[-1]["content"])

    return src, build_chat_input, [2, ids["<|user|>"], ids["<|observation|>"]]


MAKERS = {"qwen": make_qwen, "baichuan": make_baichuan, "chatglm3": make_chatglm3}


@pytest.fixture(scope="module", params=list(MAKERS))
def family(request, tmp_path_factory) -> Family:
    root = tmp_path_factory.mktemp(request.param)
    src, prompt_ids, stop_ids = MAKERS[request.param](root)
    export = quantkit.quantize(str(src), build_config(method="rtn", **{"weight.group_size": 32}),
                               work_dir=root / "export", progress=False).work_dir
    assert not list(export.rglob("*.py")) and "auto_map" not in json.loads((export / "config.json").read_text())
    return Family(export, prompt_ids, stop_ids)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny models on shared cores
    yield
    torch.set_num_threads(n)


@contextmanager
def serving(export: Path) -> Iterator[tuple[str, object]]:
    """The app of `quantkit serve EXPORT --engine-thread` (the same load_engine, create_app and settings),
    under uvicorn in a thread: (its URL, the app's Server state)."""
    import uvicorn

    from quantkit.server.app import AppSettings, create_app
    from quantkit.server.model_source import load_engine

    engine = load_engine(str(export), EngineConfig(device="cpu", num_kv_tokens=512))
    app = create_app(engine, AppSettings(served_model_name=SERVED, model_aliases=(str(export),)))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def sse_chunks(text: str) -> list[dict]:
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks and blocks[-1] == "data: [DONE]", blocks[-1:]
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def test_serve_answers_a_chat_as_the_engine_does(family, one_thread):
    from transformers import AutoTokenizer

    # The export's tokenizer, plain transformers (no remote code): its chat template is the family's format.
    tok = AutoTokenizer.from_pretrained(str(family.export))
    want_ids = family.prompt_ids(MESSAGES)
    assert encode_chat(tok, MESSAGES) == want_ids
    # The engine's own greedy answer for the same messages (the export's generation_config applies).
    engine = Engine(family.export, EngineConfig(device="cpu", num_kv_tokens=512))
    assert encode_chat(engine.tokenizer, MESSAGES) == want_ids
    want = engine.generate([want_ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), progress=False)[0]
    assert want.text and len(want.token_ids) >= 1
    del engine

    with serving(family.export) as (url, server):
        # The family's end-of-turn tokens reach the sampling settings the server resolves for a request.
        assert list(server.info.generation_config.eos_token_id) == family.stop_ids
        body = {"model": SERVED, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS}
        params = server.params(parse_request(json.dumps(body).encode(), ChatCompletionRequest), len(want_ids), 0)
        assert params.eos_token_ids == family.stop_ids and params.temperature == 0
        models = requests.get(url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [SERVED]

        r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        whole = r.json()
        assert whole["choices"][0]["message"]["content"] == want.text
        assert whole["choices"][0]["finish_reason"] == want.finish_reason
        assert whole["usage"] == {"prompt_tokens": len(want_ids), "completion_tokens": len(want.token_ids),
                                  "total_tokens": len(want_ids) + len(want.token_ids)}

        r = requests.post(url + "/v1/chat/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        chunks = sse_chunks(r.text)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == want.text
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == [want.finish_reason]
        assert chunks[-1]["usage"]["prompt_tokens"] == len(want_ids)
        assert chunks[-1]["usage"]["completion_tokens"] == len(want.token_ids)
    assert not [m for m in sys.modules if m.startswith(REMOTE_PREFIXES)]


def test_engine_info_crosses_to_the_engine_process(family):
    """What `quantkit serve` (the engine in a process of its own) sends the HTTP side: the tokenizer and the
    generation config, pickled; they encode the chat and hold the stop tokens as the engine's own do."""
    import pickle

    from quantkit.server.engine_requests import EngineInfo

    engine = Engine(family.export, EngineConfig(device="cpu", num_kv_tokens=512))
    info = pickle.loads(pickle.dumps(EngineInfo.of(engine)))
    assert encode_chat(info.tokenizer, MESSAGES) == family.prompt_ids(MESSAGES)
    assert list(info.generation_config.eos_token_id) == family.stop_ids


@pytest.mark.parametrize("family", ["chatglm3"], indirect=True)
def test_quantkit_serve_command_on_the_export(family, one_thread, tmp_path):
    """`quantkit serve EXPORT --port 0` itself (the CLI, the engine in its own process), on one family (a
    process start costs ~10 s; the others' exports differ from it only in what the test above checks):
    the same whole answer."""
    from quantkit_testing.serve_process import ServerProcess

    engine = Engine(family.export, EngineConfig(device="cpu", num_kv_tokens=512))
    want = engine.generate([family.prompt_ids(MESSAGES)], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           progress=False)[0]
    del engine
    server = ServerProcess(str(family.export), "--num-kv-tokens", "512", "--quiet", log=tmp_path / "serve.log")
    try:
        r = requests.post(server.url + "/v1/chat/completions", timeout=120,
                          json={"messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["message"]["content"] == want.text
        assert out["usage"]["prompt_tokens"] == len(family.prompt_ids(MESSAGES))
    finally:
        assert server.stop() == 0, server.output()[-3000:]

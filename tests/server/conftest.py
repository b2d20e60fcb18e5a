"""Fixtures of tests/server: the tiny chat model on disk, its tokenizer, and the shared `quantkit serve`
subprocess (helpers in tests/support/quantkit_testing/serve_process.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit_testing.serve_process import SERVED_NAME, ServerProcess, metrics, write_chat_model


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    return write_chat_model(tmp_path_factory.mktemp("serve") / "tiny-chat")


@pytest.fixture(scope="session")
def chat_tokenizer(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model_dir))


@pytest.fixture(scope="session")
def qk_server(chat_model_dir, tmp_path_factory):
    """The suite's shared server: 32 sequences per batch, a 4096-token KV pool, no key."""
    server = ServerProcess(str(chat_model_dir), "--served-model-name", SERVED_NAME, "--num-kv-tokens", "4096",
                           "--max-num-seqs", "32", "--quiet",
                           log=tmp_path_factory.mktemp("serve-log") / "server.log")
    # The flags reached the engine: a pool of 4096 tokens in 16-token blocks, nothing held yet.
    m = metrics(server.url)
    assert m["quantkit_kv_blocks_total"] == 4096 // 16 and m["quantkit_kv_blocks_used"] == 0
    yield server
    # Whatever the tests sent, SIGTERM still drains and exits cleanly.
    code = server.stop()
    assert code == 0, server.log_path.read_text()[-3000:]

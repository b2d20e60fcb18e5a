"""`quantkit serve` over a tiny LLaVA: OpenAI image content parts (a data: URL or a local file path) give
the engine's own answer for that image; a URL to download, a broken image, an image for a text-only
model are one-line 400s in OpenAI's error body."""

from __future__ import annotations

import base64
import io

import pytest
import requests
import torch

from serve_process import ServerProcess
from tiny_llava import make_image, write_tiny_llava

PROMPT = "describe the cache"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("serve-llava") / "tiny-llava", next_=True, seed=1)


@pytest.fixture(scope="module")
def llava_server(llava_dir, tmp_path_factory):
    server = ServerProcess(str(llava_dir), "--num-kv-tokens", "1024", "--quiet",
                           log=tmp_path_factory.mktemp("serve-llava-log") / "server.log")
    yield server
    server.stop()


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(url: str, image_url, text: str = PROMPT) -> requests.Response:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image_url", "image_url": image_url}]}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_image_parts_answer_as_the_engine(llava_server, llava_dir, tmp_path):
    from quantkit.engine import EngineConfig, SamplingParams
    from quantkit.engine.llm_engine import Engine

    images = [make_image(0), make_image(1, (100, 70))]
    engine = Engine(llava_dir, EngineConfig(device="cpu", dtype=torch.float32, num_kv_tokens=1024))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [engine.generate([[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                            {"type": "image", "image": im}]}]], params,
                            progress=False)[0].text for im in images]
    assert want[0] != want[1]

    r = _chat(llava_server.url, {"url": _data_url(images[0])})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want[0]
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] > 16  # image tokens count
    path = tmp_path / "second.png"
    images[1].save(path)
    r = _chat(llava_server.url, {"url": str(path)})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want[1]


@pytest.mark.parametrize("image_url,words", [
    ({"url": "https://example.com/tiger.jpeg"}, "not downloaded"),
    ({"url": "data:image/png;base64,not-base64!"}, "base64"),
    ({"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}, "not an image"),
    ({"url": "/nonexistent/tiger.jpeg"}, "does not exist"),
    ({}, "image_url part needs"),
])
def test_unusable_images_are_400s(llava_server, image_url, words):
    r = _chat(llava_server.url, image_url)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and "\n" not in error["message"] and error["type"] == "invalid_request_error"


def test_a_text_model_refuses_images(qk_server):
    r = _chat(qk_server.url, {"url": _data_url(make_image(0))})
    assert r.status_code == 400
    assert "takes no images" in r.json()["error"]["message"]

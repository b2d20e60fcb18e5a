"""`quantkit serve` over a tiny LLaVA: OpenAI image content parts (a data: URL, or a file under
--allowed-local-media-path) give the engine's own answer for that image; a local file without the flag or
outside its directory, a URL to download, a broken, oversized or bomb image, an image for a text-only
model are one-line 400s in OpenAI's error body, the same one for every path the server will not read,
and the server answers the next request."""

from __future__ import annotations

import base64

import pytest
import requests
import torch

from quantkit_testing.serve_process import ServerProcess
from quantkit_testing.tiny_llava import data_url, make_image, png_header_only, write_tiny_llava

PROMPT = "describe the cache"
MAX_IMAGE_BYTES = 100_000


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("serve-llava") / "tiny-llava", next_=True, seed=1)


@pytest.fixture(scope="module")
def llava_server(llava_dir, tmp_path_factory):
    """No --allowed-local-media-path: data: URLs only."""
    server = ServerProcess(str(llava_dir), "--num-kv-tokens", "1024", "--quiet",
                           "--max-image-bytes", str(MAX_IMAGE_BYTES),
                           log=tmp_path_factory.mktemp("serve-llava-log") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """root/ (the server's media directory) with an image, a sub-directory, a symlink out of it; an image
    beside it, outside."""
    base = tmp_path_factory.mktemp("media")
    root = base / "root"
    (root / "sub").mkdir(parents=True)
    make_image(1, (100, 70)).save(root / "second.png")
    make_image(2).save(base / "secret.png")
    (root / "escape.png").symlink_to(base / "secret.png")
    return root


@pytest.fixture(scope="module")
def media_server(llava_dir, media, tmp_path_factory):
    server = ServerProcess(str(llava_dir), "--num-kv-tokens", "1024", "--quiet",
                           "--allowed-local-media-path", str(media),
                           log=tmp_path_factory.mktemp("serve-media-log") / "server.log")
    yield server
    server.stop()


def _chat(url: str, image_url, text: str = PROMPT) -> requests.Response:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image_url", "image_url": image_url}]}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=120)


def _error(r: requests.Response) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "\n" not in error["message"] and error["type"] == "invalid_request_error"
    return error["message"]


def test_image_parts_answer_as_the_engine(llava_server, media_server, llava_dir, media):
    from quantkit.engine import EngineConfig, SamplingParams
    from quantkit.engine.llm_engine import Engine

    images = [make_image(0), make_image(1, (100, 70))]
    engine = Engine(llava_dir, EngineConfig(device="cpu", dtype=torch.float32, num_kv_tokens=1024))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [engine.generate([[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                            {"type": "image", "image": im}]}]], params,
                            progress=False)[0].text for im in images]
    assert want[0] != want[1]

    r = _chat(llava_server.url, {"url": data_url(images[0])})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want[0]
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] > 16  # image tokens count
    # media/second.png is images[1]: as a path, relative to the directory, a file:// URL.
    for url in (str(media / "second.png"), "second.png", f"file://{media / 'second.png'}"):
        r = _chat(media_server.url, {"url": url})
        assert r.status_code == 200, (url, r.text)
        assert r.json()["choices"][0]["message"]["content"] == want[1]


def test_local_files_need_the_flag(llava_server, media):
    for url in (str(media / "second.png"), f"file://{media / 'second.png'}", "/nonexistent/tiger.jpeg"):
        message = _error(_chat(llava_server.url, {"url": url}))
        assert "reads no local files" in message and "--allowed-local-media-path" in message


def test_only_files_under_the_directory(media_server, media):
    outside = str(media.parent / "secret.png")
    refused = [outside, f"file://{outside}", "escape.png", str(media / "escape.png"), "../secret.png",
               f"{media}/../secret.png", f"file://{media}/sub/../../secret.png", "missing.png",
               str(media.parent / "missing.png"), "sub", "/etc/passwd"]
    messages = {_error(_chat(media_server.url, {"url": url})).replace(repr(url), "PATH") for url in refused}
    # Outside or missing, a file or not: the same sentence, so that a client learns nothing of the server's files.
    assert messages == {("cannot read image PATH: local images are read only under --allowed-local-media-path, "
                         "and this one is not a readable image file there")}
    assert _chat(media_server.url, {"url": "second.png"}).status_code == 200


@pytest.mark.parametrize("image_url,words", [
    ({"url": "https://example.com/tiger.jpeg"}, "not downloaded"),
    ({"url": "data:image/png;base64,not-base64!"}, "base64"),
    ({"url": data_url(b"not an image")}, "not an image"),
    ({"url": data_url(png_header_only(300, 300, data=b"\xff" * 64))}, "not an image PIL can read"),
    ({"url": data_url(bytes(MAX_IMAGE_BYTES + 1))}, f"over the limit of {MAX_IMAGE_BYTES:,} bytes"),
    ({"url": "data:image/png;base64," + base64.b64encode(bytes(3 * MAX_IMAGE_BYTES)).decode()}, "--max-image-bytes"),
    ({"url": data_url(png_header_only(6000, 6000))}, "6000x6000 pixels, over the limit of 25,000,000"),
    ({"url": data_url(png_header_only(30000, 30000))}, "pixels, over the limit of 25,000,000"),
    ({}, "image_url part needs"),
])
def test_unusable_images_are_400s_and_the_server_serves_on(llava_server, image_url, words):
    assert words in _error(_chat(llava_server.url, image_url))
    r = _chat(llava_server.url, {"url": data_url(make_image(3))})
    assert r.status_code == 200, r.text


def test_a_text_model_refuses_images(qk_server):
    r = _chat(qk_server.url, {"url": data_url(make_image(0))})
    assert r.status_code == 400
    assert "takes no images" in r.json()["error"]["message"]

"""Image prompts in the engine: which rows of a step take image features, the prefix cache never serving
one image's blocks to another, chunked prefill through the image tokens (load_image: test_images.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quantkit.config import UserError
from quantkit.engine import EngineConfig, SamplingParams
from quantkit.engine.llm_engine import Engine
from quantkit.engine.multimodal import ImageInputs, step_embeds
from quantkit_testing.tiny_llava import make_image, write_tiny_llava

PROMPT = "describe the cache"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _seq(n_tokens: int, computed: int, images=None):
    return SimpleNamespace(num_computed_tokens=computed, images=images, token_ids=[0] * n_tokens)


def test_step_embeds_picks_the_rows_of_each_chunk():
    embeds = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    images = ImageInputs([2, 3, 4, 9, 10], embeds, hash=7)
    assert images.span(0, 3) == (0, 1) and images.span(3, 10) == (1, 4) and images.span(11, 20) == (5, 5)
    # A text-only sequence (4 new tokens), then the image sequence's chunk [3, 10): rows 4+0, 4+1, 4+6.
    batch = [(_seq(8, 4), 4), (_seq(12, 3, images), 7), (_seq(20, 19, images), 1)]
    rows, values = step_embeds(batch, torch.device("cpu"))
    assert rows.tolist() == [4, 5, 10]
    assert torch.equal(values, embeds[1:4])
    assert step_embeds([(_seq(8, 4), 4), (_seq(20, 11, images), 1)], torch.device("cpu")) is None
    with pytest.raises(ValueError):
        ImageInputs([1, 2], embeds, hash=0)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("mm") / "llava", next_=False, seed=0)


def _engine(path, **settings) -> Engine:
    return Engine(path, EngineConfig(device="cpu", dtype=torch.float32, num_kv_tokens=1024, cuda_graphs=False, **settings))


def _message(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": PROMPT}]}]


def test_prefix_cache_is_keyed_by_the_image(llava_dir):
    """Two prompts with the same tokens but different images share no block; the same image again does."""
    images = [make_image(0), make_image(1)]
    plain = _engine(llava_dir, enable_prefix_caching=False)
    want = [plain.generate([_message(im)], GREEDY, progress=False)[0].token_ids for im in images]
    assert want[0] != want[1]

    engine = _engine(llava_dir)
    prompts = [engine.multimodal_prompt(_message(im)) for im in images]
    assert prompts[0].token_ids == prompts[1].token_ids and prompts[0].images.hash != prompts[1].images.hash
    got = []
    for image in (images[0], images[1], images[0]):
        before = engine.stats()["prefix_cache_hits"]
        got.append((engine.generate([_message(image)], GREEDY, progress=False)[0].token_ids,
                    engine.stats()["prefix_cache_hits"] - before))
    assert got[0] == (want[0], 0)
    assert got[1] == (want[1], 0)  # same tokens, other image: recomputed
    assert got[2][0] == want[0] and got[2][1] >= 32  # the first image again: its full blocks reused


def test_chunked_prefill_through_the_image_tokens(llava_dir):
    image = make_image(4, (80, 60))
    whole = _engine(llava_dir, enable_prefix_caching=False).generate([_message(image)], GREEDY, progress=False)
    chunked = _engine(llava_dir, enable_prefix_caching=False, max_num_batched_tokens=5)
    assert chunked.generate([_message(image)], GREEDY, progress=False)[0].token_ids == whole[0].token_ids


def test_prompts_without_their_images_are_refused(llava_dir):
    engine = _engine(llava_dir)
    with pytest.raises(UserError, match="no image"):
        engine.add_request([{"role": "user", "content": "<image>\n" + PROMPT}])
    with pytest.raises(UserError, match="unknown content part"):
        engine.add_request([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])
    text_only = SimpleNamespace(vision=None)
    with pytest.raises(UserError, match="takes no images"):
        Engine.multimodal_prompt(text_only, _message(make_image(0)))
    assert Engine.multimodal_prompt(text_only, "plain text") == "plain text"


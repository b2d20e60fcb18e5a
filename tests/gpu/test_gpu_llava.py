"""LLaVA-NeXT on CUDA: image prompts prefilled eagerly beside text prompts whose decode steps replay the
CUDA graphs, fp16 and a W4 g128 export, checked teacher-forced against transformers' own Llava class.

At every generated position our token must be transformers' argmax or within a hair of it (fp16 sums
in another order part near-ties now and then), as in test_gpu_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit_testing.tiny_llava import make_image, write_tiny_llava

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
NEW = 16
NEAR_TIE = 0.02
PROMPT = "describe the cache"
# Kernel shapes: every input dimension a multiple of 128.
TEXT = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import quantkit
    from quantkit.config import QuantizeConfig, WeightQuantConfig

    root = tmp_path_factory.mktemp("gpu_llava")
    src = write_tiny_llava(root / "fp16", next_=True, seed=1, text=TEXT)
    w4 = quantkit.quantize(str(src), QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 128)),
                           work_dir=root / "w4", progress=False).work_dir
    return {"fp16": src, "w4g128": w4}


def _message(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": PROMPT}]}]


def worst_gap(model, processor, image, ours: list[int]) -> float:
    """The largest (best logit − our token's logit) / (row spread) over our tokens, teacher-forced."""
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[image], return_tensors="pt").to(DEVICE)
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([ours], device=DEVICE)], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    if "pixel_values" in extra:
        extra["pixel_values"] = extra["pixel_values"].to(torch.float16)
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0, n - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(ours, device=DEVICE)[:, None])[:, 0]
    gap = (logits.max(1).values - chosen) / (logits.max(1).values - logits.min(1).values)
    return float(gap.max())


@pytest.mark.parametrize("checkpoint", ["fp16", "w4g128"])
def test_image_prompts_beside_graphed_decodes(checkpoints, checkpoint):
    import quantkit
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = checkpoints[checkpoint]
    engine = Engine(path, EngineConfig(device=DEVICE, cache_max_entry_count=0.05, max_num_seqs=4))
    assert engine.vision is not None and engine.runner.graphs
    replays = {"n": 0}
    replay = engine.runner._replay

    def counted(step, bucket):
        assert step.input_embeds is None  # image rows never go through a decode graph
        replays["n"] += 1
        return replay(step, bucket)

    engine.runner._replay = counted
    images = [make_image(0), make_image(1, (100, 70))]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([_message(images[0]), "the model quantizes", _message(images[1])], params,
                              progress=False)
    assert replays["n"] > 0
    if checkpoint == "fp16":
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float16).to(DEVICE).eval()
    else:
        model = quantkit.load(path, device=DEVICE)[0]
    processor = AutoProcessor.from_pretrained(str(path))
    for image, out in ((images[0], outputs[0]), (images[1], outputs[2])):
        assert len(out.token_ids) == NEW
        assert worst_gap(model, processor, image, out.token_ids) <= NEAR_TIE

"""LLaVA and LLaVA-NeXT (llava-hf layout): the engine answers image prompts as transformers does; the
language model quantizes, the export keeps the vision half byte for byte and loads in transformers'
own Llava classes (through quantkit.load) with the engine's greedy answer.

The reference is transformers' LlavaForConditionalGeneration / LlavaNextForConditionalGeneration (native
classes, no remote code) on tiny random checkpoints written in the llava-hf layout by tests/support/quantkit_testing/tiny_llava.py.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit import build_config
from quantkit.engine import EngineConfig, SamplingParams
from quantkit.engine.llm_engine import Engine
from quantkit.engine.sequence import Sequence
from quantkit.models import llava
from quantkit.models.loading import load_fp_model
from quantkit_testing.tiny import make_text
from quantkit_testing.tiny_llava import make_image, messages, write_tiny_llava

FAMILIES = ["llava", "llava_next"]
PROMPT = "describe the cache"
TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    # NeXT's seed 1: a tiny random model whose answers differ from image to image.
    return {"llava": write_tiny_llava(root / "llava", next_=False, seed=0),
            "llava_next": write_tiny_llava(root / "llava_next", next_=True, seed=1)}


def _engine(path: Path, **settings) -> Engine:
    config = dict(device="cpu", dtype=torch.float32, num_kv_tokens=1024, cuda_graphs=False)
    return Engine(path, EngineConfig(**{**config, **settings}))


def _hf(path: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(path))


def _hf_inputs(processor, image):
    text = processor.apply_chat_template(messages(PROMPT), add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=[image], return_tensors="pt")


def _hf_greedy(model, processor, image) -> list[int]:
    inputs = _hf_inputs(processor, image)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=TOKENS)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _engine_logits(engine: Engine, prompt, chunks: list[int]) -> torch.Tensor:
    """The engine's logits of every prompt token, the prompt prefilled in chunks of the given sizes."""
    seq = Sequence(prompt.token_ids)
    seq.images = prompt.images
    engine.block_manager.allocate(seq)
    logits = []
    for n in chunks:
        logits.append(engine.runner.prompt_logits([(seq, n)]))
        seq.num_computed_tokens += n
    engine.block_manager.deallocate(seq)
    return torch.cat(logits)


def test_names_convert_both_ways(checkpoints):
    """The language model's tensors get Llama names and back; the vision half is left out of the language
    model; quantkit.load's renaming to transformers' module names puts every tensor where transformers'
    own loading puts it."""
    from quantkit.runtime.loader import _transformers_names

    path = checkpoints["llava_next"]
    sd = load_file(str(path / "model.safetensors"))
    lm = llava.language_state_dict(sd, {})
    assert {n.split(".")[0] for n in lm} == {"model", "lm_head"}
    assert len(lm) == len([n for n in sd if n.startswith("language_model.")])
    assert {llava.source_name(n) for n in lm} == {n for n in sd if n.startswith("language_model.")}
    vision = [n for n in sd if not n.startswith("language_model.")]
    assert "image_newline" in vision and any(n.startswith("vision_tower.vision_model.") for n in vision)

    model, _ = _hf(path)
    native = model.state_dict()
    to_transformers = _transformers_names(model.config)
    renamed = to_transformers({k: v.float() for k, v in sd.items()}, set(native))
    assert set(renamed) == set(native)
    assert all(torch.equal(renamed[k], native[k]) for k in native)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_prompt_logits_match_transformers(checkpoints, family):
    """Prefill logits of an image prompt, whole and in chunks that split the image's tokens, against
    transformers' forward (fp32, rel. err ≤ 1e-4); the language model alone as quantkit.load_fp_model
    loads it, on text, against transformers' Llava on the same text."""
    path = checkpoints[family]
    model, processor = _hf(path)
    inputs = _hf_inputs(processor, make_image(3, (60, 90)))
    with torch.no_grad():
        want = model(**inputs).logits[0]
    engine = _engine(path, enable_prefix_caching=False)
    prompt = engine.vision.encode([{"role": "user", "content": [
        {"type": "image", "image": make_image(3, (60, 90))}, {"type": "text", "text": PROMPT}]}])
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    first = prompt.images.positions[0]
    for chunks in ([len(prompt.token_ids)], [first + 3, len(prompt.token_ids) - first - 3]):
        assert _rel_err(_engine_logits(engine, prompt, chunks), want) <= 1e-4, chunks

    text_ids = processor.tokenizer(PROMPT + " of every token", return_tensors="pt")["input_ids"]
    lm = load_fp_model(path, dtype=torch.float32)
    assert type(lm.model).__name__ == "LlamaForCausalLM" and lm.spec.name == family
    with torch.no_grad():
        assert _rel_err(lm.model(text_ids).logits, model(input_ids=text_ids).logits) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_answers_as_transformers_generate(checkpoints, family):
    """`quantkit.pipeline(path)((text, image))`, lmdeploy's form, gives transformers' greedy tokens; a
    batch of two images gives each its own answer (the image is what differs)."""
    path = checkpoints[family]
    model, processor = _hf(path)
    images = [make_image(0), make_image(1, (100, 70))]
    want = [_hf_greedy(model, processor, im) for im in images]
    assert want[0] != want[1]
    pipe = quantkit.pipeline(str(path), device="cpu", dtype=torch.float32, num_kv_tokens=1024, cuda_graphs=False)
    got = pipe([(PROMPT, im) for im in images], max_tokens=TOKENS, temperature=0.0, ignore_eos=True, progress=False)
    assert [r.token_ids for r in got] == want
    single = pipe((PROMPT, images[1]), max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    assert single[0].token_ids == want[1]


@pytest.mark.parametrize("family,method", [("llava", "awq"), ("llava_next", "int8"), ("llava_next", "rtn")])
def test_quantized_export_keeps_vision_and_loads_in_transformers(checkpoints, tmp_path, family, method):
    src = checkpoints[family]
    overrides = {"weight.group_size": 32}
    calib = None
    if method == "awq":
        overrides.update({"calib.samples": 4, "calib.seqlen": 32})
        calib = [make_text(600, 5)]
    if method == "int8":  # as `quantkit int8` sets it: W8, a scale per output channel, compressed-tensors
        overrides = {"weight.bits": 8, "weight.group_size": -1, "weight.symmetric": True, "format": "compressed-tensors"}
    res = quantkit.quantize(str(src), build_config(method=method, **overrides), calib=calib,
                            work_dir=tmp_path / "q", progress=False)
    out = res.work_dir
    cfg = json.loads((out / "config.json").read_text())
    source_cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == source_cfg["architectures"] and cfg["model_type"] == family
    assert cfg["text_config"] == source_cfg["text_config"] and cfg["vision_config"] == source_cfg["vision_config"]
    qc = cfg["quantization_config"]
    if qc["quant_method"] == "awq":
        assert {"vision_tower", "multi_modal_projector", "model.vision_tower", "lm_head"} <= set(qc["modules_to_not_convert"])
    else:
        assert qc["ignore"] == llava.COMPRESSED_IGNORE
    for f in ("processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f

    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    vision = [n for n in before if not n.startswith("language_model.")]
    assert vision and all(after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]) for n in vision)
    assert (qc["quant_method"], method) != ("awq", "int8")
    packed = "qweight" if qc["quant_method"] == "awq" else "weight_packed"
    assert f"language_model.model.layers.1.mlp.down_proj.{packed}" in after
    assert not [n for n in after if n.startswith(("model.", "lm_head"))]  # nothing left under converted names

    # transformers' own Llava class holds the export (quantkit.load); its greedy answer is the engine's.
    image = make_image(2, (70, 50))
    model, _ = quantkit.load(out, device="cpu")
    assert type(model).__name__ == type(_hf(src)[0]).__name__
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(out))
    want = _hf_greedy(model, processor, image)
    engine = _engine(out)
    inputs = _hf_inputs(processor, image)
    prompt = engine.multimodal_prompt([{"role": "user", "content": [{"type": "image", "image": image},
                                                                    {"type": "text", "text": PROMPT}]}])
    with torch.no_grad():
        assert _rel_err(_engine_logits(engine, prompt, [len(prompt)]), model(**inputs).logits[0]) <= 1e-4
    got = engine.generate([[{"role": "user", "content": [{"type": "image", "image": image},
                                                          {"type": "text", "text": PROMPT}]}]],
                          SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True), progress=False)
    assert got[0].token_ids == want


def test_cli_quantizes_and_chat_answers_on_the_export(checkpoints, tmp_path, monkeypatch):
    """`quantkit rtn` on the llava-hf checkpoint, then a text chat on the export (the processor's template)."""
    from quantkit.cli import main
    from quantkit.engine.chat import run_chat

    out = tmp_path / "w4"
    monkeypatch.setattr(sys, "argv", ["quantkit", "rtn", str(checkpoints["llava"]), "--work-dir", str(out),
                                      "--group-size", "32", "--format", "compressed-tensors"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code in (0, None)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == llava.COMPRESSED_IGNORE
    engine = _engine(out)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    written = io.StringIO()
    run_chat(engine, params, stdin=io.StringIO("the model quantizes\nexit\n"), stdout=written)
    answer = written.getvalue().split(">>> ")[1].strip()
    want = engine.generate([[{"role": "user", "content": "the model quantizes"}]], params, progress=False)[0].text
    assert answer and answer == want.strip()

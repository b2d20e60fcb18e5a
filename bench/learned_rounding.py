"""Learned rounding (`--rounding learned`) against error-feedback rounding (`--rounding gptq`).

Quality, on SmolLM2-135M-Instruct (the demo model) on the CPU:

    python -m bench.learned_rounding --bits 4 --threads 2 --json bench/results/learned_rounding_w4g64.json
    python -m bench.learned_rounding --bits 3 --threads 2 --datasets ptb

Both roundings quantize a fresh copy of the fp16 model with the same AWQ search (calibration: 128
windows of 512 tokens of ptb.valid.txt, seed 0, g64) and are evaluated by perplexity on the first 40
windows of 512 tokens of each test text, fp32: PTB, WikiText-2, and pydoc (the second half of Python's
own documentation topics, `pydoc_data.topics`: neither PTB nor WikiText, never used to tune anything).
Besides the figures: quantize time, and per block the output error of the gptq codes and of the
learned ones over the calibration windows, and which was kept.

Speed and memory of the user's command on a Llama-2-7B-shape checkpoint (random fp16 weights written
to disk first, as bench/awq_speed.py does; one GPU):

    PYTHONPATH=. python -m bench.learned_rounding --speed 7b --root /tmp/qk-learned
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

import torch

from bench.awq_quality import DATA_DIR, evaluate, smollm2_path, with_bits
from quantkit.config import build_config
from quantkit.models.loading import load_fp_model
from quantkit.quantize.api import quantize


def quality(args) -> None:
    datasets = args.datasets.split(",")
    loaded = load_fp_model(smollm2_path())
    rows = []
    for rounding in args.roundings.split(","):
        model = copy.deepcopy(loaded.model)
        config = with_bits(build_config(method="awq", format="awq", **{
            "weight.bits": 4, "weight.group_size": args.group_size, "calib.dataset": "ptb", "calib.samples": args.samples,
            "calib.seqlen": 512, "calib.data_dir": DATA_DIR, "calib.seed": args.seed, "awq.rounding": rounding,
            "learn.steps": args.steps, "learn.lr": args.lr, "learn.batch": args.batch}), args.bits)
        t0 = time.perf_counter()
        res = quantize(type(loaded)(model, loaded.tokenizer, loaded.spec, loaded.source), config, progress=args.progress)
        seconds = time.perf_counter() - t0
        info = res.report["awq"]
        row = {"rounding": rounding, **evaluate(model, loaded.tokenizer, datasets, args.eval_windows),
               "quantize_s": round(seconds, 1), "phases_s": info["phases_s"]}
        learned = [b["learned"] for b in info["blocks"] if "learned" in b]
        if learned:
            row["blocks_kept_learned"] = sum(e["kept"] == "learned" for e in learned)
            row["blocks"] = [{k: e[k] for k in ("loss_start", "loss_learned", "kept", "codes_changed", "clip_mean", "seconds")}
                             for e in learned]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "blocks"}), flush=True)
        del model, res
    print(f"\nSmolLM2-135M-Instruct W{args.bits} g{args.group_size}, calibration {args.samples}×512 ptb-valid seed {args.seed}, "
          f"learning {args.steps} steps, lr {args.lr}, {args.batch} window(s) per step; eval {args.eval_windows}×512 fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print("| rounding | " + " | ".join(f"{d} ppl" for d in datasets) + " | blocks kept learned | quantize s |")
    print("|---|" + "---|" * (len(datasets) + 2))
    for r in rows:
        kept = f"{r['blocks_kept_learned']}/{len(r['blocks'])}" if "blocks" in r else "—"
        print(f"| {r['rounding']} | " + " | ".join(f"{r[d]:.2f}" for d in datasets) + f" | {kept} | {r['quantize_s']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


def speed(args) -> None:
    from bench.awq_speed import SHAPES, run_watched, write_random_checkpoint, write_text

    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    model, text, out = args.root / f"llama-{args.speed}", args.root / "calib.txt", args.root / "out"
    fp16_bytes = write_random_checkpoint(model, SHAPES[args.speed], "cuda" if torch.cuda.is_available() else "cpu")
    write_text(text, 4 * args.samples * 512)
    row = run_watched(["awq", str(model), "--w-bits", "4", "--group-size", "128", "--calib-dataset", str(text),
                       "--calib-samples", str(args.samples), "--calib-seqlen", "512", "--rounding", "learned",
                       "--learn-steps", str(args.steps), "--work-dir", str(out)], args.timeout)
    report = json.loads((out / "quant_report.json").read_text()) if (out / "quant_report.json").is_file() else {}
    awq = report.get("awq", {})
    row.update(shape=args.speed, fp16_gb=round(fp16_bytes / 1024**3, 2), rss_ratio=round(row["peak_rss_gb"] * 1024**3 / fp16_bytes, 3),
               peak_gpu_gb=report.get("peak_gpu_memory_gb"), phases_s=awq.get("phases_s"),
               learn_s_per_block=[b["learned"]["seconds"] for b in awq.get("blocks", []) if "learned" in b],
               kept=[b["learned"]["kept"] for b in awq.get("blocks", []) if "learned" in b])
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2))
    shutil.rmtree(args.root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="calibration window sampling seed")
    ap.add_argument("--roundings", default="gptq,learned")
    ap.add_argument("--steps", type=int, default=200, help="learn.steps")
    ap.add_argument("--lr", type=float, default=5e-3, help="learn.lr")
    ap.add_argument("--batch", type=int, default=1, help="learn.batch: windows per step")
    ap.add_argument("--datasets", default="ptb,wikitext2,pydoc")
    ap.add_argument("--eval-windows", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--progress", action="store_true", help="show the per-block progress bar")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--speed", default=None, help="instead: time `quantkit awq --rounding learned` on this shape (7b, 13b, tiny)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/qk-learned"), help="--speed: scratch folder (emptied)")
    ap.add_argument("--timeout", type=float, default=560, help="--speed: seconds before the command is killed")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    speed(args) if args.speed else quality(args)


if __name__ == "__main__":
    main()

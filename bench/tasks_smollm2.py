"""Task accuracy of SmolLM2-135M-Instruct (CPU) against its RTN W4 g64 and AWQ W4 g64 checkpoints:
`quantkit compare --tasks` on hellaswag, arc_easy, arc_challenge, piqa, winogrande, boolq and mmlu.

    python -m bench.tasks_smollm2 [--out /tmp/quantkit_tasks] [--limit 500] [--mmlu-limit 20]

Makes the checkpoints as bench/compare_smollm2.py does (reused when already in --out), then runs the same calls as

    quantkit compare SmolLM2-135M-Instruct.Q4_1.gguf OUT/rtn-w4g64 OUT/awq-w4g64 \
        --tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande,boolq --limit 500 --output OUT/tasks.md
    quantkit compare … --tasks mmlu --limit 20 --output OUT/mmlu.md

(MMLU's limit is per subject, hence its own call). Prints both tables, and the original model's scoring time
of the seven tasks (its rows' seconds: the wall time of `quantkit eval tasks` at these limits, model load aside).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import time
from pathlib import Path

SIX = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/quantkit_tasks"), help="checkpoints and reports")
    ap.add_argument("--limit", type=int, default=500, help="first N documents of each task but MMLU")
    ap.add_argument("--mmlu-limit", type=int, default=20, help="first N documents of each MMLU subject")
    ap.add_argument("--awq-samples", type=int, default=128, help="AWQ calibration windows of 512 PTB tokens")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    import torch

    from bench.compare_smollm2 import GGUF, make_checkpoints
    from quantkit.eval.accuracy import TaskSettings
    from quantkit.eval.compare import compare
    from quantkit.eval.report import markdown_table

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    paths, _ = make_checkpoints(args.out, args.awq_samples)
    checkpoints = [p for p in paths if p.name in ("rtn-w4g64", "awq-w4g64")]
    results, seconds = {}, 0.0
    for name, tasks, limit in (("tasks", SIX, args.limit), ("mmlu", ("mmlu",), args.mmlu_limit)):
        start = time.perf_counter()
        result = compare(GGUF, checkpoints, device="cpu", output=args.out / f"{name}.md", progress=False,
                         tasks=TaskSettings(tasks, limit=limit))
        print(f"compare {name}: {time.perf_counter() - start:.0f}s", flush=True)
        print(markdown_table(result), flush=True)
        seconds += sum(r.seconds for r in result.rows[0].tasks.values())
        results[name] = result.to_dict()
    print(f"original model, seven tasks: {seconds:.0f}s of scoring on {torch.get_num_threads()} threads")
    (args.out / "tasks.json").write_text(json.dumps({**results, "original_seconds": seconds}))


if __name__ == "__main__":
    main()

"""`quantkit awq` / `rtn` / `int8` as a user runs them, on Llama-2-7B / 13B-shape checkpoints on disk.

    PYTHONPATH=. python -m bench.awq_speed --root /tmp/qk-bench --json bench/results/awq_speed_h200.json
    PYTHONPATH=. python -m bench.awq_speed --shapes tiny --root /tmp/qk-tiny    # the same path on a CPU, seconds

For each shape: a random fp16 safetensors checkpoint (Llama config, a small fast tokenizer) is
written to disk, with a calibration text of random words; then each command runs as a subprocess,
exactly as typed by a user:

    quantkit awq MODEL --w-bits 4 --group-size 128 --calib-dataset TEXT --calib-samples 128 --calib-seqlen 512 --work-dir OUT
    quantkit rtn MODEL --w-bits 4 --group-size 128 --work-dir OUT
    quantkit int8 MODEL --work-dir OUT

Measured per run: wall time of the subprocess; peak GPU memory (torch's allocator, from the run's
quant_report.json); peak resident memory (the child's VmHWM, read from /proc/PID/status every 50 ms,
so a peak in the last 50 ms before exit is missed) and, polled there too, peak RssAnon (anonymous memory: what the process holds, not counting the
mapped pages of the source checkpoint, RssFile) — against the fp16 checkpoint's size on disk.
A shape's checkpoint is deleted before the next shape is written.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024),
}
GB = 1024**3


def block_bytes(shape: dict) -> int:
    """fp16 bytes of one decoder block (its linears; the two norms are negligible)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


@torch.no_grad()
def write_random_checkpoint(directory: Path, shape: dict, gen_device: str) -> int:
    """A LlamaForCausalLM checkpoint of N(0, 0.02) fp16 weights (norms near 1), sharded as the Hub
    ships it, with a fast tokenizer whose ids are < the vocabulary; returns its bytes on disk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.formats.checkpoint import write_safetensors
    from bench.lib.common import use_test_helpers
    use_test_helpers()
    from quantkit_testing.tiny import make_tokenizer

    directory.mkdir(parents=True)
    config = LlamaConfig(**shape, tie_word_embeddings=False, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
                         bos_token_id=1, eos_token_id=2, dtype="float16")
    config.save_pretrained(str(directory))
    make_tokenizer().save_pretrained(str(directory))
    with torch.device("meta"):
        names = [(n, p.shape) for n, p in LlamaForCausalLM(config).named_parameters()]
    gen = torch.Generator(gen_device).manual_seed(0)

    def tensors():
        for name, s in names:
            if len(s) == 1:
                t = torch.rand(s, device=gen_device, generator=gen) * 0.5 + 0.75
            else:
                t = torch.randn(s, device=gen_device, generator=gen) * 0.02
            yield name, t.to(torch.float16).cpu()

    write_safetensors(directory, tensors(), shard_bytes=5 * GB)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def write_text(path: Path, words: int) -> None:
    from bench.lib.common import use_test_helpers
    use_test_helpers()
    from quantkit_testing.tiny import make_text

    path.write_text(make_text(words, seed=3))


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def run_watched(args: list[str], timeout: float) -> dict:
    """Run `quantkit ARGS` as a child process, polling its memory; returns the figures."""
    cmd = [sys.executable, "-m", "quantkit.cli", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: deque[str] = deque(maxlen=25)
    reader = threading.Thread(target=lambda: [tail.append(line.rstrip()[-300:]) for line in proc.stdout], daemon=True)
    reader.start()
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    status = None
    while status is None:
        for key, value in _status(proc.pid).items():
            if key in peak:
                peak[key] = max(peak[key], value)
        pid, code = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            status = os.waitstatus_to_exitcode(code)
        elif time.perf_counter() - t0 > timeout:
            proc.kill()
        else:
            time.sleep(0.05)
    proc.returncode = status
    wall = time.perf_counter() - t0
    reader.join(timeout=5)
    # VmHWM, not wait4's ru_maxrss: the latter keeps the peak of the forked parent from before exec.
    return {"command": "quantkit " + " ".join(args), "exit_code": status, "wall_s": round(wall, 1),
            "peak_rss_gb": round(peak["VmHWM"] / GB, 2), "peak_rss_polled_gb": round(peak["VmRSS"] / GB, 2),
            "peak_rss_anon_gb": round(peak["RssAnon"] / GB, 2), "peak_rss_file_gb": round(peak["RssFile"] / GB, 2),
            "output_tail": list(tail)}


def bench_shape(name: str, root: Path, commands: list[str], calib: dict, timeout: float) -> list[dict]:
    shape = SHAPES[name]
    model, text = root / f"llama-{name}", root / "calib.txt"
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    fp16_bytes = write_random_checkpoint(model, shape, gen_device)
    write_text(text, 4 * calib["samples"] * calib["seqlen"])
    print(f"{name}: wrote {fp16_bytes / GB:.2f} GB in {time.perf_counter() - t0:.0f}s", flush=True)
    args = {
        "awq": ["awq", str(model), "--w-bits", "4", "--group-size", "128", "--calib-dataset", str(text),
                "--calib-samples", str(calib["samples"]), "--calib-seqlen", str(calib["seqlen"])],
        "rtn": ["rtn", str(model), "--w-bits", "4", "--group-size", "128"],
        "int8": ["int8", str(model)],
    }
    rows = []
    for command in commands:
        out = root / f"out-{name}-{command}"
        row = run_watched([*args[command], "--work-dir", str(out)], timeout)
        row.update(shape=name, fp16_gb=round(fp16_bytes / GB, 2), block_gb=round(block_bytes(shape) / GB, 3),
                   rss_ratio=round(row["peak_rss_gb"] * GB / fp16_bytes, 3))
        report_file = out / "quant_report.json"
        if report_file.is_file():
            report = json.loads(report_file.read_text())
            row.update(report_wall_s=round(report.get("wall_time_s", 0), 1),
                       peak_gpu_gb=round(report.get("peak_gpu_memory_gb", 0), 2) if "peak_gpu_memory_gb" in report else None,
                       timings_s={k: round(v, 1) for k, v in report.get("timings_s", {}).items()},
                       awq_phases_s=report.get("awq", {}).get("phases_s"),
                       export_gb=round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / GB, 2))
        print(json.dumps({k: v for k, v in row.items() if k != "output_tail"}), flush=True)
        if row["exit_code"] != 0:
            print("\n".join(row["output_tail"]), flush=True)
        rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(model, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="scratch folder for checkpoints and exports (emptied)")
    ap.add_argument("--shapes", default="7b", help="comma list of 7b, 13b, tiny")
    ap.add_argument("--commands", default="awq,rtn,int8", help="comma list of awq, rtn, int8 (for every shape)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=480, help="seconds per command before it is killed")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here as JSON (appended to after each shape)")
    args = ap.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    env = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        rows += bench_shape(shape, args.root, args.commands.split(","), {"samples": args.samples, "seqlen": args.seqlen},
                            args.timeout)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"environment": env, "runs": rows}, indent=2))
    print(f"\n{env['device']}, {env['date']}")
    print("| command | shape | wall s | peak GPU GB | peak RSS GB (× fp16) | peak RssAnon GB | block GB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['command'].split(' ')[0]} {r['command'].split(' ')[1]}` | {r['shape']} | {r['wall_s']} | "
              f"{r.get('peak_gpu_gb')} | {r['peak_rss_gb']} ({r['rss_ratio']}×) | {r['peak_rss_anon_gb']} | {r['block_gb']} |")


if __name__ == "__main__":
    main()

"""Servers under load, side by side: starts `quantkit serve` and/or `transformers serve` (or any server
command), one at a time, waits until it answers, runs `quantkit bench serve`'s sweep against it, stops
it, and writes one table, JSON and plot of all of them (serve.md, serve.json, serve.png in --out-dir,
each server's log beside them). Servers already running are given by URL.

    # quantkit W4 on a random Llama-2-7B shape, and transformers' continuous batching in fp16 at 64:
    python -m bench.serve --out-dir OUT --quantkit random:llama2-7b:w4 --transformers random:llama2-7b
    # any running server(s):
    python -m bench.serve --out-dir OUT --url vllm=http://127.0.0.1:8000 --model vllm=qwen-7b
    # any command that starts a server ({port} is replaced by a free port):
    python -m bench.serve --out-dir OUT --server "lmdeploy=lmdeploy serve api_server M --server-port {port}"
    # every request constrained by a JSON schema (response_format json_schema), against the same server:
    python -m bench.serve --out-dir OUT --quantkit random:llama2-7b:w4 --json-schema bench/schemas/record.json

`--transformers random:SHAPE` first writes a random-weight fp16 checkpoint of that shape to --work-dir
(not under --out-dir: 13.5 GB for 7B) with the byte-level tokenizer `quantkit serve random:...` uses,
so both servers see the same prompt tokens, and with no EOS token, so that transformers (which refuses
`ignore_eos`) also answers --output-len tokens. A directory is served as it is.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from quantkit.server.bench_report import load_runs, report_text, write_report
from quantkit.server.bench_serve import BenchServeConfig, bench_serve, parse_levels


@dataclass
class Target:
    label: str
    url: Optional[str] = None           # a running server
    command: Optional[list[str]] = None  # or a command to start, with {port}
    model: Optional[str] = None
    concurrency: Optional[tuple[int, ...]] = None
    num_prompts: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until GET /health or /v1/models answers 200; raises if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before answering")
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(url + path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer within {timeout:.0f}s")


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def write_random_hf(shape: str, out: Path) -> Path:
    """A random fp16 checkpoint of `shape` with the random models' byte-level tokenizer and no EOS."""
    import torch

    from bench.lib.random_checkpoint import write
    from quantkit.engine.random_model import shape_config
    from quantkit.server.model_source import byte_tokenizer

    if (out / "config.json").exists():
        print(f"using the checkpoint in {out}", flush=True)
        return out
    tok_dir = out.parent / f"{out.name}-tokenizer"
    byte_tokenizer(shape_config(shape).vocab_size).save_pretrained(str(tok_dir))
    print(f"writing a random {shape} fp16 checkpoint to {out}", flush=True)
    write(shape, out, tok_dir, "cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():  # give the weights' memory back before a server wants it
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    for name in ("config.json", "generation_config.json"):  # no EOS: answers run to max_tokens
        p = out / name
        cfg = json.loads(p.read_text())
        cfg["eos_token_id"] = None
        p.write_text(json.dumps(cfg, indent=2))
    return out


def run_target(t: Target, args: argparse.Namespace, out_dir: Path):
    proc, log = None, out_dir / f"{t.label}.log"
    url = t.url
    try:
        if t.command:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [c.replace("{port}", str(port)) for c in t.command]
            print(f"[{t.label}] starting: {shlex.join(cmd)} (log: {log})", flush=True)
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, **t.env})
            start = time.monotonic()
            wait_ready(url, proc, args.startup_timeout)
            print(f"[{t.label}] ready after {time.monotonic() - start:.0f}s", flush=True)
        cfg = BenchServeConfig(url=url, model=t.model, concurrency=t.concurrency or parse_levels(args.concurrency),
                               num_prompts=t.num_prompts or args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, timeout=args.timeout, seed=args.seed, label=t.label,
                               api_key=args.api_key, extra_body=response_format(args.json_schema))
        return bench_serve(cfg, progress=True)
    except Exception as exc:  # one server's failure must not lose the others' results
        print(f"[{t.label}] FAILED: {type(exc).__name__}: {exc}\n{tail(log)}", file=sys.stderr, flush=True)
        return None
    finally:
        if proc is not None:
            stop(proc)
            print(f"[{t.label}] stopped (exit code {proc.returncode})", flush=True)


def response_format(path: Optional[Path]) -> dict:
    """The extra request field that constrains every request by the JSON schema in `path` (none: {})."""
    if path is None:
        return {}
    schema = json.loads(path.read_text())
    return {"response_format": {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}}


def targets_from(args: argparse.Namespace) -> list[Target]:
    models = dict(kv.split("=", 1) for kv in args.model)
    out: list[Target] = []
    if args.quantkit:
        label = args.quantkit_label
        cmd = [sys.executable, "-m", "quantkit.cli", "serve", args.quantkit, "--host", "127.0.0.1", "--port", "{port}",
               "--served-model-name", label, *shlex.split(args.quantkit_args)]
        out.append(Target(label, command=cmd, model=label))
    if args.transformers:
        path = args.transformers
        if path.startswith("random:"):
            path = str(write_random_hf(path.split(":", 1)[1], Path(args.work_dir) / f"hf-{path.split(':')[1]}-fp16"))
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", path, "--continuous-batching",
               "--dtype", "float16", "--host", "127.0.0.1", "--port", "{port}", *shlex.split(args.transformers_args)]
        out.append(Target(args.transformers_label, command=cmd, model=path,
                          concurrency=parse_levels(args.transformers_concurrency),
                          num_prompts=args.transformers_num_prompts))
    for spec in args.server:
        label, command = spec.split("=", 1)
        out.append(Target(label, command=shlex.split(command), model=models.get(label)))
    for spec in args.url:
        label, url = spec.split("=", 1)
        out.append(Target(label, url=url, model=models.get(label)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out-dir", type=Path, required=True, help="serve.md/.json/.png and the servers' logs")
    ap.add_argument("--quantkit", metavar="MODEL", help="start `quantkit serve MODEL` (e.g. random:llama2-7b:w4)")
    ap.add_argument("--quantkit-args", default="", help="more flags for quantkit serve, e.g. '--kv-bits 8'")
    ap.add_argument("--quantkit-label", default="quantkit")
    ap.add_argument("--transformers", metavar="DIR", help="start `transformers serve DIR --continuous-batching "
                    "--dtype float16`; random:SHAPE writes a random checkpoint first (see above)")
    ap.add_argument("--transformers-args", default="", help="more flags for transformers serve")
    ap.add_argument("--transformers-label", default="transformers-fp16")
    ap.add_argument("--transformers-concurrency", default="64", help="its levels (it is slow: 64 by default)")
    ap.add_argument("--transformers-num-prompts", type=int, help="its requests per level (default as below)")
    ap.add_argument("--server", action="append", default=[], metavar="LABEL=COMMAND",
                    help="a command that starts a server on 127.0.0.1:{port} (repeatable)")
    ap.add_argument("--url", action="append", default=[], metavar="LABEL=URL", help="a running server (repeatable)")
    ap.add_argument("--model", action="append", default=[], metavar="LABEL=NAME",
                    help="the model name to request from --server/--url LABEL (default: its first /v1/models)")
    ap.add_argument("--compare", action="append", default=[], type=Path,
                    help="a serve.json of an earlier run to put in the same table (repeatable)")
    ap.add_argument("--concurrency", default="1,4,8,16,64,128")
    ap.add_argument("--num-prompts", type=int, help="requests per level (default: max(4 × concurrency, 32))")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to answer")
    ap.add_argument("--api-key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="/tmp/quantkit-bench-serve", help="where random checkpoints are written")
    ap.add_argument("--json-schema", type=Path, metavar="FILE", help="constrain every request to JSON valid under "
                    "the schema in FILE (response_format json_schema; bench/schemas/record.json forces at least "
                    "1,000 characters, so answers run to --output-len)")
    args = ap.parse_args()
    for spec in [*args.server, *args.url, *args.model]:
        if "=" not in spec:
            ap.error(f"{spec!r}: write LABEL=VALUE")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = [run for path in args.compare for run in load_runs(path)]
    targets = targets_from(args)
    if not targets and not runs:
        ap.error("nothing to measure: give --quantkit, --transformers, --server or --url")
    failed = 0
    for t in targets:
        run = run_target(t, args, args.out_dir)
        failed += run is None
        if run is not None:
            runs.append(run)
            write_report(runs, args.out_dir, stem="serve")  # after each server: nothing lost if a later one hangs
    if runs:
        print(report_text(runs))
        paths = write_report(runs, args.out_dir, stem="serve")
        print("wrote " + ", ".join(str(p) for p in paths.values() if p))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

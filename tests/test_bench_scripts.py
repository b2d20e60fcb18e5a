"""Every runnable file of bench/ answers `--help` both ways the docs show: `python -m bench.NAME` from the
repository root and `python bench/NAME.py` from anywhere (a file's own folder then heads sys.path until
the script puts the root there: bench/ once held a kernels.py that shadowed the `kernels` package
transformers imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def runnable_scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_bench_script_answers_help_as_a_module_and_as_a_file(tmp_path):
    scripts = runnable_scripts()
    assert len(scripts) > 20 and BENCH / "throughput.py" in scripts
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    runs = {}
    for script in scripts:  # all at once: each mostly waits on importing torch
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
        runs[f"python -m {module}"] = subprocess.Popen(
            [sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs[f"python {script.relative_to(ROOT)}"] = subprocess.Popen(
            [sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = {}
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = out[-1500:]
    assert not failed, "\n\n".join(f"{name} → {out}" for name, out in failed.items())

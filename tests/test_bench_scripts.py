"""Every runnable file of bench/ answers `--help` both ways the docs show: `python -m bench.NAME` from the
repository root and `python bench/NAME.py` from anywhere (a file's own folder then heads sys.path until
the script puts the root there: bench/ once held a kernels.py that shadowed the `kernels` package
transformers imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    commands = {}
    for script in scripts:
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
        commands[f"python -m {module}"] = ([sys.executable, "-m", module, "--help"], ROOT)
        commands[f"python {script.relative_to(ROOT)}"] = ([sys.executable, str(script), "--help"], tmp_path)

    def run(item):
        name, (cmd, cwd) = item
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        return name, None if proc.returncode == 0 and "usage:" in out else out[-1500:]

    # A few at a time: each mostly imports torch, and all at once would hold many GB on a 2-core machine.
    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = {name: out for name, out in pool.map(run, commands.items()) if out is not None}
    assert not failed, "\n\n".join(f"{name} → {out}" for name, out in failed.items())

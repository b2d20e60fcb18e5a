"""What `bench.soak` reads of the server besides its answers: /metrics, the memory of its processes (the
server and every child: `quantkit serve` runs its engine in a child process), and the engine process
itself, to kill it."""

from __future__ import annotations

import shutil
import subprocess
from typing import Optional

import psutil

MIB = 2**20


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}; comments and unparsable lines skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def metric(values: dict[str, float], name: str) -> Optional[float]:
    """A metric's value, summed over its labelled series; None when the server does not export it."""
    found = [v for k, v in values.items() if k == name or k.startswith(name + "{")]
    return sum(found) if found else None


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (those that exist now)."""
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def rss_mib(pid: int) -> float:
    """Resident memory of the server and its children together."""
    total = 0
    for p in tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:    # ended while we looked
            pass
    return total / MIB


def gpu_mib(pid: int) -> Optional[float]:
    """GPU memory that nvidia-smi lists for the server's processes; None where there is no nvidia-smi or it
    lists none of them (in a container its pids may be the host's)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    used = compute_apps_mib(out)
    mine = [used[p.pid] for p in tree(pid) if p.pid in used]
    return sum(mine) if mine else None


def compute_apps_mib(csv: str) -> dict[int, float]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` as {pid: MiB}; rows
    without a number ("[N/A]") are left out, a pid on several GPUs summed."""
    used: dict[int, float] = {}
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                used[int(parts[0])] = used.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return used


def engine_process(server_pid: int) -> Optional[psutil.Process]:
    """The server's engine: a child started by multiprocessing (`spawn_main`), not its resource tracker;
    the largest by resident memory if there are several. None if there is none (e.g. --engine-thread)."""
    found = []
    for child in psutil.Process(server_pid).children():
        try:
            cmd = " ".join(child.cmdline())
            if "multiprocessing" in cmd and "resource_tracker" not in cmd:
                found.append((child.memory_info().rss, child))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return max(found, key=lambda f: f[0])[1] if found else None

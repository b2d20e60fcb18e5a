"""tests/server's helpers: `quantkit serve` as a real subprocess on 127.0.0.1 (a free port it picks
itself) over a tiny random Llama whose tokenizer has a chat template, waited on /health, SIGTERMed
(then killed) at the end, optionally with a fault hook in its step loop (`FaultDir`); /metrics read as
numbers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from quantkit_testing.tiny import make_tiny_model, make_tokenizer

# System turns, alternating roles, and an end token after each turn, as real chat templates have; tools
# and earlier tool calls written as Hermes-style templates write them (<tool_call>…</tool_call>).
# (The tools are named, not shown whole: the tiny model's context is 256 tokens.)
CHAT_TEMPLATE = ("{% if tools %}<|system|>Call <tool_call>{name, arguments}</tool_call>: "
                 "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}</s>{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                 "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SERVED_NAME = "tiny-chat"
START_TIMEOUT = 120.0


def write_chat_model(directory: Path) -> Path:
    make_tiny_model("llama").save_pretrained(str(directory))
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    return directory


class FaultDir:
    """A step hook for `launch.serve(before_step=...)`: a file `stall` in `directory` makes the next step
    hang, `crash` makes it raise (each file is removed when it fires)."""

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)

    def __call__(self) -> None:
        if _take(self.dir / "crash"):
            raise RuntimeError("injected fault: the step failed")
        if _take(self.dir / "stall"):
            threading.Event().wait()  # hangs: nothing ever sets it (the server's watchdog must notice)


def _take(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


class ServerProcess:
    """A `quantkit serve` child process; `url` once it answers /health. With `faults` (a directory) its
    engine steps through `FaultDir(faults)` (quantkit_testing.serve_with_faults)."""

    def __init__(self, model: str, *args: str, log: Path, faults: Optional[Path] = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log_path = log
        self.log = open(log, "w")
        entry = ["quantkit.cli"]
        if faults is not None:
            support = str(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [support, env.get("PYTHONPATH")]))
            entry = ["quantkit_testing.serve_with_faults", str(faults)]
        cmd = [sys.executable, "-m", *entry, "serve", model, "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_ready()

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def _wait_ready(self) -> str:
        import requests

        deadline = time.monotonic() + START_TIMEOUT
        url: Optional[str] = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quantkit serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            if url is None:
                m = re.search(r"will answer at (http://\S+)", self.output())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if requests.get(url + "/health", timeout=2).status_code == 200:
                        return url
                except requests.RequestException:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"quantkit serve did not answer /health in {START_TIMEOUT:.0f} s:\n{self.output()[-3000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> Optional[int]:
        """SIGTERM, wait (bounded), kill if needed; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode


def metrics(url: str) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value}."""
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(condition, timeout: float, what: str = "the condition"):
    """Poll `condition` until it gives a true value, which is returned; an AssertionError naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.02)


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no sequence is in flight and no KV block is held; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["quantkit_num_requests_in_flight"] == 0 and m["quantkit_kv_blocks_used"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def assert_error(r, status: int, param=None, code=None) -> dict:
    """r (a requests.Response) is `status` with OpenAI's error body naming `param` and `code`; the error."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param and err["code"] == code, err
    return err

"""`quantkit demo` as a user sees it, run on a tiny chat model (`--model`) in a subprocess: one line per
result, no library notes the user cannot act on, no line twice, answers shown whole."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from quantkit.demo import up_to_last_sentence
from quantkit_testing.serve_process import write_chat_model
from quantkit_testing.tiny import make_text

PROGRESS_BAR = re.compile(r"\d+%\|.*\|")  # tqdm's "name:  40%|████      | 4/10 [...]"


def printed_lines(output: str) -> list[str]:
    """What stays on the screen: tqdm redraws its bar with carriage returns; the bars themselves are not lines."""
    lines = [part.rstrip() for line in output.split("\n") for part in line.split("\r")]
    return [line for line in lines if line.strip() and not PROGRESS_BAR.search(line)]


def test_the_demo_reads_clean(tmp_path):
    model = write_chat_model(tmp_path / "tiny-chat")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))  # 512-token windows
    data = tmp_path / "data"
    data.mkdir()
    (data / "ptb.valid.txt").write_text(make_text(6000, seed=1))
    (data / "ptb.test.txt").write_text(make_text(6000, seed=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "demo", "--model", str(model), "--data-dir", str(data),
                           "--work-dir", str(tmp_path / "runs" / "demo"), "--calib-samples", "2", "--eval-windows", "2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = printed_lines(proc.stdout + "\n" + proc.stderr)
    text = "\n".join(lines)
    assert "> Hi, pls intro yourself" in text and "> 上海是" in text and "total time" in text
    assert not re.search(r"warn|\[transformers\]|fontManager|dtype float32 on|KV pool:|block \d+: search", text, re.I), text
    repeated = {line for line in lines if lines.count(line) > 1 and set(line.strip()) - set("─━│┃┏┓┗┛┡┩└┘┌┐╇┼ ")}
    assert not repeated, f"printed twice: {repeated}\n{text}"
    assert len(lines) <= 30, f"{len(lines)} lines:\n{text}"
    assert (tmp_path / "runs" / "demo" / "config.json").is_file()


def test_an_answer_cut_at_the_limit_is_shown_to_its_last_sentence():
    assert up_to_last_sentence("I am a model. I help with tasks! And I like to wri") == "I am a model. I help with tasks!"
    assert up_to_last_sentence("上海是中国的城市。它很大，而且") == "上海是中国的城市。"
    assert up_to_last_sentence("Ends well.") == "Ends well."
    assert up_to_last_sentence("  no sentence end at all ") == "no sentence end at all"
    assert up_to_last_sentence("Version 1.5 is out and it") == "Version 1.5 is out and it"  # "1.5" ends nothing

"""Calibration and evaluation text: local directories first, offline errors name the file, seeded windows."""

import json

import pytest
import torch

from quantkit.config import CalibConfig
from quantkit.data import (
    DataError,
    calibration_windows,
    check_calibration,
    evaluation_windows,
    load_calibration,
    load_text,
    window_sampling,
)


def test_local_dir_first(tmp_path, monkeypatch):
    (tmp_path / "ptb.valid.txt").write_text("hello world\n")
    text, src = load_text("ptb", "valid", str(tmp_path))
    assert text == "hello world\n" and src.origin.endswith("ptb.valid.txt")
    monkeypatch.setenv("QUANTKIT_DATA_DIR", str(tmp_path))
    assert load_text("ptb", "valid")[0] == "hello world\n"


def test_offline_error_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("QUANTKIT_DATA_DIR", raising=False)
    with pytest.raises(DataError, match=r"wiki2\.test\.txt"):
        load_text("wikitext2", "test")


def test_builtin_pydoc_text_is_available_offline():
    text, src = load_text("pydoc", "valid")
    test_text, _ = load_text("pydoc", "test")
    assert len(text) > 100_000 and len(test_text) > 100_000 and src.origin == "builtin:pydoc_data.topics"
    assert text[:2000] not in test_text


def test_jsonl_and_txt(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in ["a b", "c d"]))
    assert load_text(str(p))[0] == "a b\n\nc d"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n')
    with pytest.raises(DataError, match="text"):
        load_text(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        load_text(str(tmp_path / "missing.txt"))


def test_windows_seeded_and_shaped():
    tokens = torch.arange(10_000)
    a = calibration_windows(tokens, 8, 64, seed=3)
    b = calibration_windows(tokens, 8, 64, seed=3)
    c = calibration_windows(tokens, 8, 64, seed=4)
    assert a.shape == (8, 64) and torch.equal(a, b) and not torch.equal(a, c)
    # Each window is a contiguous slice of the text.
    assert (a[:, 1:] - a[:, :-1] == 1).all()
    ev = evaluation_windows(tokens, 1000, limit=3)
    assert ev.shape == (3, 1000) and ev[1, 0] == 1000
    with pytest.raises(DataError):
        calibration_windows(torch.arange(10), 1, 64)


@pytest.mark.parametrize("seed", range(20))
def test_windows_do_not_overlap_where_the_text_holds_them(seed):
    # 15 windows of 64 in 1000 tokens: only 40 tokens to spare, so draws with replacement would overlap
    windows = calibration_windows(torch.arange(1000), 15, 64, seed=seed)
    starts = windows[:, 0].sort().values
    assert (starts[1:] - starts[:-1] >= 64).all() and starts[-1] + 64 <= 1000
    assert window_sampling(1000, 15, 64) == "distinct, non-overlapping"


def test_windows_overlap_at_distinct_offsets_then_repeat(caplog):
    # 50 windows of 64 in 200 tokens: 137 offsets, so distinct but overlapping
    with caplog.at_level("WARNING", logger="quantkit.data"):
        starts = calibration_windows(torch.arange(200), 50, 64, seed=0)[:, 0]
    assert len(set(starts.tolist())) == 50
    assert "overlapping" in window_sampling(200, 50, 64) and "overlapping" in caplog.text
    # 20 windows of 64 in 70 tokens: 7 offsets, each used twice or three times (no offset favoured)
    starts = calibration_windows(torch.arange(70), 20, 64, seed=0)[:, 0]
    counts = torch.bincount(starts, minlength=7)
    assert counts.sum() == 20 and counts.min() >= 2 and counts.max() <= 3
    assert window_sampling(70, 20, 64).startswith("repeated: the text has 7 distinct windows")


def test_one_window_exactly_fits():
    assert torch.equal(calibration_windows(torch.arange(16), 1, 16)[0], torch.arange(16))
    with pytest.raises(DataError, match="has 15 tokens, fewer than one window of 16"):
        calibration_windows(torch.arange(15), 1, 16)


def test_load_calibration_reports_the_sampling(tmp_path):
    class CharTokenizer:
        def __call__(self, text, **kwargs):
            return {"input_ids": [ord(c) for c in text]}

    p = tmp_path / "t.txt"
    p.write_text("x" * 300)
    _, source = load_calibration(CharTokenizer(), str(p), 4, 64)
    assert source.sampling == "distinct, non-overlapping"
    _, source = load_calibration(CharTokenizer(), str(p), 8, 64)
    assert source.sampling.startswith("distinct offsets, overlapping: the text holds 4 non-overlapping windows")


def test_calibration_text_checked_before_any_model(tmp_path):
    cfg = CalibConfig(samples=4, seqlen=64)
    with pytest.raises(DataError, match="does not exist"):
        check_calibration(str(tmp_path / "missing.txt"), cfg)
    (tmp_path / "empty.txt").write_text(" \n\n")
    with pytest.raises(DataError, match="empty"):
        check_calibration(str(tmp_path / "empty.txt"), cfg)
    (tmp_path / "short.txt").write_text("a few words")
    with pytest.raises(DataError, match="11 bytes, too few for one window of 64 tokens"):
        check_calibration(str(tmp_path / "short.txt"), cfg)
    with pytest.raises(DataError, match="empty"):
        check_calibration(["", "  "], cfg)
    with pytest.raises(DataError, match="directory"):
        check_calibration(str(tmp_path), cfg)
    (tmp_path / "ok.txt").write_text("word " * 20)
    check_calibration(str(tmp_path / "ok.txt"), cfg)  # 100 bytes may hold 64 tokens: left to the tokenizer
    check_calibration(["short texts shorten the window"], cfg)
    check_calibration(torch.zeros(2, 64, dtype=torch.long), cfg)


def test_manifest_is_package_data():
    import importlib.resources
    import tomllib
    from pathlib import Path

    manifest = importlib.resources.files("quantkit") / "calib_data" / "manifest.json"
    assert set(json.loads(manifest.read_text())) == {"ptb", "wikitext2", "pydoc"}
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "calib_data/manifest.json" in pyproject["tool"]["setuptools"]["package-data"]["quantkit"]


def test_named_datasets_work_from_a_wheel_install(tmp_path):
    """`pip install .` (not editable): build the wheel from a copy of the sources, install it into a
    folder and resolve a named dataset from there, away from the source tree."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "quantkit", src / "quantkit", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("quantkit-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import quantkit, quantkit.data as d; print(quantkit.__file__); "
             "print(d.load_text('pydoc', 'valid')[1].origin)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode == 0, out.stderr
    installed, origin = out.stdout.split()
    assert installed.startswith(str(tmp_path / "site")) and origin == "builtin:pydoc_data.topics"

"""Calibration and evaluation text: local directories first, offline errors name the file, seeded windows."""

import json

import pytest
import torch

from quantkit.data import DataError, calibration_windows, evaluation_windows, load_text


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

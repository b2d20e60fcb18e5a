"""Bad input through the CLI: one line on stderr, a non-zero exit, nothing written or lost."""

import json
import subprocess
import sys

import pytest

from quantkit.cli import main


def run_cli(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quantkit", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def assert_one_line_error(code, err, *needles):
    assert code not in (0, None)
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


def test_missing_path(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["rtn", str(tmp_path / "nope"), "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert_one_line_error(code, err, "does not exist")
    assert not (tmp_path / "o").exists()


def test_not_a_model_dir(tmp_path, monkeypatch, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hi")
    code, _, err = run_cli(["int8", str(tmp_path / "d"), "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert_one_line_error(code, err, "not a model directory")


def test_unsupported_architecture(tmp_path, monkeypatch, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    code, _, err = run_cli(["rtn", str(tmp_path / "gpt2"), "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert_one_line_error(code, err, "GPT2LMHeadModel", "LlamaForCausalLM")


def test_group_size_not_dividing(tiny_models, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["rtn", str(tiny_models["llama"]), "--group-size", "48", "--work-dir", str(tmp_path / "o")],
                           monkeypatch, capsys)
    assert_one_line_error(code, err, "--group-size 48", "does not divide")
    assert not (tmp_path / "o").exists()


def test_five_bits_in_awq_format(tiny_models, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["rtn", str(tiny_models["llama"]), "--w-bits", "5", "--format", "awq",
                            "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert_one_line_error(code, err, "--w-bits 5", "awq")


def test_non_empty_work_dir_kept(tiny_models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, _, err = run_cli(["rtn", str(tiny_models["llama"]), "--work-dir", str(out)], monkeypatch, capsys)
    assert_one_line_error(code, err, "not empty", "--overwrite")
    assert (out / "keep.txt").read_text() == "precious"


def test_truncated_checkpoint(tiny_models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    code, _, _ = run_cli(["rtn", str(tiny_models["llama"]), "--group-size", "32", "-q", "--work-dir", str(out)], monkeypatch, capsys)
    assert code in (0, None)
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    code, _, err = run_cli(["generate", str(out), "hello"], monkeypatch, capsys)
    assert_one_line_error(code, err, "model.safetensors", "truncated")


def test_console_script_help_and_error(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "quantkit.cli", "rtn", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0
    for flag in ("--w-bits", "--group-size", "--format", "--work-dir", "--overwrite", "--recipe"):
        assert flag in help_text.stdout
    bad = subprocess.run([sys.executable, "-m", "quantkit.cli", "rtn", str(tmp_path / "x"), "--work-dir", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.startswith("error:")


def test_named_dataset_offline_without_local_copy(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("QUANTKIT_DATA_DIR", raising=False)
    from quantkit import data

    data._hub_reachable.cache_clear()
    code, _, err = run_cli(["awq", str(tiny_models["llama"]), "--calib-dataset", "wikitext2", "--group-size", "32",
                            "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert_one_line_error(code, err, "wiki2.valid.txt", "--data-dir")
    assert not (tmp_path / "o").exists()
    data._hub_reachable.cache_clear()


def test_awq_rounding_flag(tiny_models, text_file, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["awq", str(tiny_models["llama"]), "--rounding", "floor", "--work-dir", str(tmp_path / "o")],
                           monkeypatch, capsys)
    assert_one_line_error(code, err, "rounding", "nearest or gptq")
    assert not (tmp_path / "o").exists()
    out = tmp_path / "n"
    code, _, _ = run_cli(["awq", str(tiny_models["llama"]), "--rounding", "nearest", "--calib-dataset", str(text_file), "--calib-samples", "2", "--calib-seqlen", "16",
                          "--group-size", "32", "--n-grid", "2", "--no-clip", "--device", "cpu", "--quiet",
                          "--work-dir", str(out)], monkeypatch, capsys)
    assert code in (0, None)
    report = json.loads((out / "quant_report.json").read_text())
    assert report["config"]["awq"]["rounding"] == "nearest"

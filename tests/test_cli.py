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
    assert report["calibration"]["sampling"] == "distinct, non-overlapping"


def test_learned_rounding_flags(tiny_models, text_file, tmp_path, monkeypatch, capsys):
    """Bad learning settings are one-line errors before any work; `rtn --rounding learned` calibrates."""
    model = str(tiny_models["llama"])
    for flags, needles in ((["awq", model, "--rounding", "learned", "--learn-steps", "0"], ("--learn-steps 0", "1 to")),
                           (["awq", model, "--rounding", "learned", "--learn-lr", "2"], ("--learn-lr 2.0",)),
                           (["rtn", model, "--rounding", "gptq"], ("rtn --rounding gptq", "nearest or learned"))):
        code, _, err = run_cli([*flags, "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
        assert_one_line_error(code, err, *needles)
        assert not (tmp_path / "o").exists()
    out = tmp_path / "r"
    code, _, _ = run_cli(["rtn", model, "--rounding", "learned", "--learn-steps", "5", "--calib-dataset", str(text_file),
                          "--calib-samples", "4", "--calib-seqlen", "16", "--group-size", "32", "--device", "cpu",
                          "--quiet", "--work-dir", str(out)], monkeypatch, capsys)
    assert code in (0, None)
    report = json.loads((out / "quant_report.json").read_text())
    assert report["method"] == "rtn" and report["calibration"]["samples"] == 4
    assert [b["learned"]["steps"] for b in report["rtn"]["blocks"]] == [5, 5]


def test_w_bits_help_and_refusal_say_what_can_be_written(tiny_models, tmp_path, monkeypatch, capsys):
    help_text = subprocess.run([sys.executable, "-m", "quantkit.cli", "rtn", "--help"], capture_output=True, text=True,
                               env={**__import__("os").environ, "COLUMNS": "200"}).stdout
    assert "4 (awq or compressed-tensors) or 8 (compressed-tensors)" in help_text and "2–8" not in help_text
    for fmt in ([], ["--format", "compressed-tensors"]):
        code, _, err = run_cli(["rtn", str(tiny_models["llama"]), "--w-bits", "3", *fmt, "--work-dir", str(tmp_path / "o")],
                               monkeypatch, capsys)
        assert_one_line_error(code, err, "--w-bits 3 cannot be written", "use --w-bits 4 or 8")


def test_cuda_without_cuda_is_one_line(tiny_models, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["awq", str(tiny_models["llama"]), "--device", "cuda", "--work-dir", str(tmp_path / "o")],
                 ["eval", "ppl", str(tiny_models["llama"]), "--device", "cuda:1"],
                 ["kv-calibrate", str(tiny_models["llama"]), "--device", "cuda", "-o", str(tmp_path / "s.safetensors")]):
        code, _, err = run_cli(argv, monkeypatch, capsys)
        assert_one_line_error(code, err, "no CUDA GPU", "--device cpu")
    code, _, err = run_cli(["eval", "ppl", str(tiny_models["llama"]), "--device", "gpu"], monkeypatch, capsys)
    assert_one_line_error(code, err, "'gpu' is not a device")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["missing", "empty", "short"])
def test_calibration_text_refused_before_the_model_loads(case, tiny_models, tmp_path, monkeypatch, capsys):
    from quantkit.quantize import api

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the calibration text was checked")

    monkeypatch.setattr(api, "_load", no_load)
    text = tmp_path / "calib.txt"
    if case != "missing":
        text.write_text("" if case == "empty" else "too short")
    code, _, err = run_cli(["awq", str(tiny_models["llama"]), "--calib-dataset", str(text), "--calib-seqlen", "64",
                            "--work-dir", str(tmp_path / "o")], monkeypatch, capsys)
    needle = {"missing": "does not exist", "empty": "is empty", "short": "too few for one window of 64 tokens"}[case]
    assert_one_line_error(code, err, needle)


def test_broken_checkpoint_config_is_one_line(tiny_models, tmp_path, monkeypatch, capsys):
    bad_json, bad_type = tmp_path / "bad_json", tmp_path / "bad_type"
    for d in (bad_json, bad_type):
        d.mkdir()
    (bad_json / "config.json").write_text('{"model_type": "llama", ')
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    (bad_type / "config.json").write_text(json.dumps({"model_type": "nonsense", "quantization_config": qc}))
    for argv, needle in ((["generate", str(bad_json), "hi"], "not valid JSON"),
                         (["generate", str(bad_type), "hi"], "nonsense"),
                         (["compare", str(tiny_models["llama"]), str(bad_json), "--dataset", "pydoc"], "not valid JSON"),
                         (["compare", str(tiny_models["llama"]), str(bad_type), "--dataset", "pydoc"], "nonsense")):
        code, out, err = run_cli(argv, monkeypatch, capsys)
        assert_one_line_error(code, err, needle)
        assert "ppl" not in out  # refused before any evaluation


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    """SIGINT while a command runs: the one-line message, exit code 130, no traceback."""
    import signal

    script = tmp_path / "wait.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background\n"
        "from quantkit import cli\n"
        "@cli.app.command('wait')\n"
        "def wait():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "sys.argv = ['quantkit', 'wait']\n"
        "cli.main()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["interrupted; nothing was written"], err


def test_generate_runs_on_the_engine(tiny_models, monkeypatch, capsys):
    """`quantkit generate` batches its prompts through the engine: the engine pipeline's greedy answers."""
    import quantkit
    from quantkit.engine import EngineConfig

    argv = ["generate", str(tiny_models["llama"]), "the model", "hello there", "--max-new-tokens", "5",
            "--kv-bits", "8", "--device", "cpu", "--json"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code in (0, None), err
    got = json.loads(out)
    pipe = quantkit.pipeline(tiny_models["llama"], EngineConfig(kv_bits=8, device="cpu"))
    want = pipe(["the model", "hello there"], max_new_tokens=5, temperature=0.0, progress=False)
    assert [r["token_ids"] for r in got] == [r.token_ids for r in want]
    assert all(r["generated_tokens"] == len(r["token_ids"]) <= 5 and r["prompt_tokens"] > 0 for r in got)
    code, _, err = run_cli(["generate", str(tiny_models["llama"]), "hi", "--top-p", "0"], monkeypatch, capsys)
    assert_one_line_error(code, err, "top_p")


def test_generate_constrained(tiny_models, tmp_path, monkeypatch, capsys):
    """--json-schema FILE, --regex and --choice constrain every answer; two of them, or a file that is no
    schema, are one line."""
    import re

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}, "required": ["n"]}))
    model = str(tiny_models["llama"])
    for flags, check in ((["--json-schema", str(schema)], lambda t: 0 <= json.loads(t)["n"] <= 9),
                         (["--regex", "[a-z]{2}-[0-9]"], lambda t: re.fullmatch("[a-z]{2}-[0-9]", t)),
                         (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no"))):
        code, out, err = run_cli(["generate", model, "the model", "keys", "--max-new-tokens", "40", "--device", "cpu",
                                  "--json", *flags], monkeypatch, capsys)
        assert code in (0, None), err
        assert all(check(r["text"]) for r in json.loads(out)), out
    code, _, err = run_cli(["generate", model, "x", "--regex", "a", "--choice", "b"], monkeypatch, capsys)
    assert_one_line_error(code, err, "--regex and --choice")
    schema.write_text("[]")
    code, _, err = run_cli(["generate", model, "x", "--json-schema", str(schema)], monkeypatch, capsys)
    assert_one_line_error(code, err, "not a schema")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_dtype_flag_reaches_the_engine_config(command, monkeypatch, capsys, engine_config_of):
    """--dtype goes to EngineConfig.dtype (auto when not given); another value is one line, before any load."""
    seen, argv = engine_config_of(command)
    for extra, want in (([], "auto"), (["--dtype", "bfloat16"], "bfloat16"), (["--dtype", "float16"], "float16")):
        code, _, err = run_cli([*argv, "--device", "cpu", *extra], monkeypatch, capsys)
        assert code in (0, None), err
        assert seen.pop().dtype == want
    code, _, err = run_cli([*argv, "--dtype", "float64"], monkeypatch, capsys)
    assert_one_line_error(code, err, "--dtype 'float64'", "auto, float16 or bfloat16")
    assert not seen


def test_int8_writes_w8_per_channel_compressed_tensors(tiny_models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "w8"
    code, stdout, err = run_cli(["int8", str(tiny_models["llama"]), "--work-dir", str(out), "-q"], monkeypatch, capsys)
    assert code in (0, None), err
    assert "(int8, compressed-tensors," in stdout
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    assert group["weights"]["symmetric"] is True


def test_fp8_help_and_bad_flags_are_one_line(tiny_models, text_file, tmp_path, monkeypatch, capsys):
    help_text = subprocess.run([sys.executable, "-m", "quantkit.cli", "fp8", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0
    for flag in ("--scheme", "--weight-strategy", "--rounding", "--calib-dataset", "--work-dir", "--overwrite", "--recipe",
                 "--device"):
        assert flag in help_text.stdout
    src, out = str(tiny_models["llama"]), str(tmp_path / "o")
    for argv, needles in (
        (["--scheme", "e5m2"], ("--scheme 'e5m2'", "dynamic or static")),
        (["--weight-strategy", "group"], ("--weight-strategy 'group'", "channel or tensor")),
        (["--scheme", "static", "--calib-dataset", str(tmp_path / "none.txt")], ("none.txt",)),
        (["--rounding", "learned"], ("--rounding 'learned'", "nearest or gptq")),
        (["--rounding", "gptq", "--calib-dataset", str(tmp_path / "none.txt")], ("none.txt",)),  # dynamic reads it too
    ):
        code, _, err = run_cli(["fp8", src, "--work-dir", out, *argv], monkeypatch, capsys)
        assert_one_line_error(code, err, *needles)
        assert not (tmp_path / "o").exists()


def test_fp8_writes_float_quantized(tiny_models, text_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "fp8"
    code, stdout, err = run_cli(["fp8", str(tiny_models["qwen2"]), "--work-dir", str(out), "--scheme", "static",
                                 "--weight-strategy", "tensor", "--calib-dataset", str(text_file), "--calib-samples",
                                 "4", "--calib-seqlen", "32", "-q"], monkeypatch, capsys)
    assert code in (0, None), err
    assert "(fp8, float-quantized," in stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized" and group["weights"]["strategy"] == "tensor"
    assert group["input_activations"] == {**group["input_activations"], "strategy": "tensor", "dynamic": False}
    report = json.loads((out / "quant_report.json").read_text())
    assert report["calibration"]["samples"] == 4
    assert report["fp8"]["rounding"] == "gptq"  # static's default: it has the calibration text anyway

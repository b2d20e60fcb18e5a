"""`compare` and the evaluation commands end to end on tiny models; bad input gives one-line errors."""

import json
import sys

import pytest

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.eval.compare import compare
from quantkit_testing.cli_run import run_cli


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    src = str(tiny_models["llama"])
    rtn = quantkit.quantize(src, QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32)), work_dir=root / "rtn",
                            progress=False).work_dir
    int8 = quantkit.quantize(src, QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True)),
                             work_dir=root / "int8", progress=False).work_dir
    return src, rtn, int8


def test_compare_table_report_and_chart(checkpoints, text_file, tmp_path):
    src, rtn, int8 = checkpoints
    out = tmp_path / "report.md"
    res = compare(src, [rtn, int8], [str(text_file)], seqlen=64, windows=2, kv_bits=[16, 8], output=out, progress=False)
    names = [(r.name, r.method, r.kv) for r in res.rows]
    assert names == [("llama", "fp", "KV16"), ("llama", "fp", "KV8 per token"), ("rtn", "rtn", "KV16"),
                     ("rtn", "rtn", "KV8 per token"), ("int8", "int8", "KV16"), ("int8", "int8", "KV8 per token")]
    fp, fp_kv8, rtn_row, int8_row = res.rows[0], res.rows[1], res.rows[2], res.rows[4]
    assert fp.top1 == {} and fp.kl == {} and fp.delta_pct == {} and res.reference == "llama at KV16"
    assert (rtn_row.bits, rtn_row.group_size, int8_row.bits, int8_row.group_size) == (4, 32, 8, -1)
    assert rtn_row.size_bytes < int8_row.size_bytes < fp.size_bytes
    d = text_file.name
    assert rtn_row.delta_pct[d] == pytest.approx(100 * (rtn_row.ppl[d] / fp.ppl[d] - 1))
    # int8 weights stay closer to the fp model than 4-bit ones, in distributions, predictions and perplexity;
    # the fp model's own KV8 rows closer still
    assert 0 < fp_kv8.kl[d] < int8_row.kl[d] < rtn_row.kl[d]
    assert 0.5 < rtn_row.top1[d] <= int8_row.top1[d] <= fp_kv8.top1[d] <= 1.0
    assert abs(int8_row.delta_pct[d]) < abs(rtn_row.delta_pct[d])
    text = out.read_text()
    assert "| rtn | rtn | 4 | 32 | KV16 |" in text and f"KL {d}" in text and f"top-1 {d}" in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"




def test_eval_ppl_json(checkpoints, text_file, monkeypatch, capsys):
    src, rtn, _ = checkpoints
    code, out, err = run_cli(monkeypatch, capsys, "eval", "ppl", src, rtn, "--dataset", text_file,
                             "--seqlen", 64, "--windows", 2, "--kv-bits", 4, "--kv-rotation", "auto", "--json")
    assert code == 0, err
    result = json.loads(out)
    rows, d = result["rows"], text_file.name
    assert [(r["name"], r["kv"]) for r in rows] == [("llama", "KV16"), ("llama", "KV4 per token, keys rotated"),
                                                    ("rtn", "KV16"), ("rtn", "KV4 per token, keys rotated")]
    assert all(r["ppl"][d] > 1 for r in rows) and result["reference"] == "each model's KV16 row"
    # each model's KV4 row against its own KV16 row, not against the first model
    assert rows[3]["delta_pct"][d] == pytest.approx(100 * (rows[3]["ppl"][d] / rows[2]["ppl"][d] - 1))
    assert rows[1]["kl"][d] > 0 and rows[3]["kl"][d] > 0 and rows[2]["kl"] == {}


@pytest.mark.parametrize("case,needle", [
    ("not-a-checkpoint", "is not a quantized checkpoint"),
    ("missing-dataset", "does not exist"),
    ("kv-bits-3", "--kv-bits 3 is not supported"),
    ("kv-rotation", "--kv-rotation 'random' is not supported"),
    ("static-without-stats", "kv-calibrate"),
])
def test_bad_input_is_one_line_and_exit_2(checkpoints, text_file, tmp_path, monkeypatch, capsys, case, needle):
    src, rtn, _ = checkpoints
    args = {
        "not-a-checkpoint": ["compare", src, src, "--dataset", text_file],
        "missing-dataset": ["eval", "ppl", rtn, "--dataset", tmp_path / "nope.txt"],
        "kv-bits-3": ["eval", "ppl", rtn, "--dataset", text_file, "--kv-bits", 3],
        "kv-rotation": ["compare", src, rtn, "--dataset", text_file, "--kv-bits", 4, "--kv-rotation", "random"],
        "static-without-stats": ["eval", "ppl", src, "--dataset", text_file, "--kv-bits", 8, "--kv-scales", "static"],
    }[case]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_kv_calibrate_command(checkpoints, text_file, tmp_path, monkeypatch, capsys):
    src, _, _ = checkpoints
    code, out, err = run_cli(monkeypatch, capsys, "kv-calibrate", src, "--calib-dataset", text_file,
                             "--calib-samples", 2, "--calib-seqlen", 32, "-q")
    assert code == 2 and "--output" in err  # an fp model directory is not written into
    code, out, err = run_cli(monkeypatch, capsys, "kv-calibrate", src, "--calib-dataset", text_file,
                             "--calib-samples", 2, "--calib-seqlen", 32, "-q", "--output", tmp_path / "s.safetensors")
    assert code == 0, err
    assert (tmp_path / "s.safetensors").is_file() and "64 tokens" in out


def test_report_without_matplotlib(checkpoints, text_file, tmp_path, monkeypatch, capsys, caplog):
    """matplotlib is optional: the Markdown report is written without the chart and says why."""
    from quantkit.eval.report import NO_CHART

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    src, rtn, _ = checkpoints
    out = tmp_path / "report.md"
    code, stdout, err = run_cli(monkeypatch, capsys, "compare", src, rtn, "--dataset", text_file, "--seqlen", 64,
                                "--windows", 1, "-q", "--output", out)
    assert code == 0, err
    assert "| rtn | rtn | 4 | 32 | KV16 |" in out.read_text() and NO_CHART in out.read_text()
    assert not out.with_suffix(".png").exists()
    assert f"wrote {out}\n" in stdout and "pip install matplotlib" in caplog.text

"""`compare` and the evaluation commands end to end on tiny models; bad input gives one-line errors."""

import json
import sys

import pytest

import quantkit
from quantkit import cli
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.eval.compare import compare


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
    assert names == [("llama", "fp", "fp"), ("llama", "fp", "KV8 online"), ("rtn", "rtn", "fp"),
                     ("rtn", "rtn", "KV8 online"), ("int8", "int8", "fp"), ("int8", "int8", "KV8 online")]
    fp, rtn_row, int8_row = res.rows[0], res.rows[2], res.rows[4]
    assert fp.top1_agreement is None and fp.delta_pct == {}
    assert (rtn_row.bits, rtn_row.group_size, int8_row.bits, int8_row.group_size) == (4, 32, 8, -1)
    assert rtn_row.size_bytes < int8_row.size_bytes < fp.size_bytes
    d = text_file.name
    assert rtn_row.delta_pct[d] == pytest.approx(100 * (rtn_row.ppl[d] / fp.ppl[d] - 1))
    # int8 weights stay closer to the fp model than 4-bit ones, in predictions as in perplexity
    assert 0.5 < rtn_row.top1_agreement <= int8_row.top1_agreement <= 1.0
    assert abs(int8_row.delta_pct[d]) < abs(rtn_row.delta_pct[d])
    text = out.read_text()
    assert "| rtn | rtn | 4 | 32 | fp |" in text and "top-1 agreement" in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_ppl_json(checkpoints, text_file, monkeypatch, capsys):
    src, rtn, _ = checkpoints
    code, out, err = run_cli(monkeypatch, capsys, "eval", "ppl", src, rtn, "--dataset", text_file,
                             "--seqlen", 64, "--windows", 2, "--kv-bits", 4, "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["kv"] for r in rows] == ["KV4 online (K per channel, g32)"] * 2 and all(r["ppl"][text_file.name] > 1 for r in rows)


@pytest.mark.parametrize("case,needle", [
    ("not-a-checkpoint", "is not a quantized checkpoint"),
    ("missing-dataset", "does not exist"),
    ("kv-bits-3", "--kv-bits 3 is not supported"),
    ("static-without-stats", "kv-calibrate"),
])
def test_bad_input_is_one_line_and_exit_2(checkpoints, text_file, tmp_path, monkeypatch, capsys, case, needle):
    src, rtn, _ = checkpoints
    args = {
        "not-a-checkpoint": ["compare", src, src, "--dataset", text_file],
        "missing-dataset": ["eval", "ppl", rtn, "--dataset", tmp_path / "nope.txt"],
        "kv-bits-3": ["eval", "ppl", rtn, "--dataset", text_file, "--kv-bits", 3],
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
    assert "| rtn | rtn | 4 | 32 | fp |" in out.read_text() and NO_CHART in out.read_text()
    assert not out.with_suffix(".png").exists()
    assert f"wrote {out}\n" in stdout and "pip install matplotlib" in caplog.text

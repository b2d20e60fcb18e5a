"""Every command that runs the engine takes the same engine flags, with the same help and defaults."""

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.engine.config import EngineConfig

ENGINE_FLAGS = ("--kv-bits", "--kv-scales", "--kv-stats", "--kv-rotation", "--device")
# Evaluation loads its models itself (eval/loading.py), so --dtype is a flag of the serving commands.
SERVING_FLAGS = ("--dtype",)
COMMANDS = {("serve",): ENGINE_FLAGS + SERVING_FLAGS, ("chat",): ENGINE_FLAGS + SERVING_FLAGS,
            ("generate",): ENGINE_FLAGS + SERVING_FLAGS, ("eval", "ppl"): ENGINE_FLAGS, ("compare",): ENGINE_FLAGS}


def _options(path):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {opt: param for param in command.params for opt in param.opts}


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_help_shows_the_engine_flags(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for flag in COMMANDS[path]:
        assert flag in result.output, (path, flag)


@pytest.mark.parametrize("flag", ENGINE_FLAGS + SERVING_FLAGS)
def test_each_engine_flag_has_one_help_text_and_default(flag):
    params = {path: _options(path)[flag] for path, flags in COMMANDS.items() if flag in flags}
    assert len({p.help for p in params.values()}) == 1, {path: p.help for path, p in params.items()}
    defaults = {path: p.default for path, p in params.items()}
    field = flag[2:].replace("-", "_")
    want = {f.name: f.default for f in dataclasses.fields(EngineConfig)}[field]
    for path, default in defaults.items():  # the evaluations' --kv-bits is a list: one row per value
        assert default in (want, [want]), (path, default)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_kv_flags_reach_the_engine_config(command, tmp_path, engine_config_of):
    """serve passes --kv-rotation and --kv-stats on as chat and generate do."""
    seen, argv = engine_config_of(command)
    stats = str(tmp_path / "kv_stats.safetensors")
    result = CliRunner().invoke(app, [*argv, "--device", "cpu", "--kv-bits", "4", "--kv-scales", "static",
                                      "--kv-stats", stats, "--kv-rotation", "none"])
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert (config.kv_bits, config.kv_scales, config.kv_stats, config.kv_rotation) == (4, "static", stats, "none")


def test_serve_scheduling_warmup_and_cache_flags_reach_the_engine_config(tmp_path, engine_config_of, monkeypatch,
                                                                         capsys):
    from quantkit_testing.cli_run import run_cli

    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    seen, argv = engine_config_of("serve")
    cache = tmp_path / "cache"
    result = CliRunner().invoke(app, [*argv, "--device", "cpu", "--no-async-scheduling", "--warmup",
                                      "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert (config.async_scheduling, config.warmup, config.cache_dir) == (False, True, str(cache))
    assert (cache / "triton").is_dir()
    result = CliRunner().invoke(app, [*argv, "--device", "cpu"])
    assert (seen[-1].async_scheduling, seen[-1].warmup, seen[-1].cache_dir) == (None, None, None)  # CUDA decides
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(monkeypatch, capsys, *argv, "--device", "cpu", "--cache-dir", blocker / "cache")
    assert code != 0 and "cannot write there" in err and len(err.strip().splitlines()) == 1
    assert len(seen) == 2                      # refused before the server was started

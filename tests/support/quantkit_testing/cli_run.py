"""`quantkit …` run in this process, as a user runs it: (exit code, stdout, stderr), a traceback refused."""

from __future__ import annotations

import sys


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run `quantkit ARGS` through cli.main() with sys.argv set (monkeypatch) and its output captured (capsys)."""
    from quantkit import cli

    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    # the CLI's edge: a failure is a one-line error and an exit code, never a traceback
    assert "Traceback (most recent call last)" not in out.err, out.err[-2000:]
    return code, out.out, out.err

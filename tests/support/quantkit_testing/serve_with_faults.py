"""`python -m quantkit_testing.serve_with_faults DIR serve ARGS...`: the `quantkit` command with
`serve_process.FaultDir(DIR)` passed to `launch.serve` as its step hook, for tests that make a real
server's engine hang or fail (a file `stall` or `crash` in DIR fires once, at the next step)."""

from __future__ import annotations

import functools
import sys

from quantkit_testing.serve_process import FaultDir

if __name__ == "__main__":
    from pathlib import Path

    from quantkit import cli
    from quantkit.server import launch

    assert len(sys.argv) > 2 and Path(sys.argv[1]).is_dir(), "usage: serve_with_faults FAULT_DIR serve ARGS..."
    launch.serve = functools.partial(launch.serve, before_step=FaultDir(sys.argv[1]))
    sys.argv = ["quantkit", *sys.argv[2:]]
    cli.main()

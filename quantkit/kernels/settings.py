"""Which kernels run, decided once: a `KernelSettings` made at the edge (`EngineConfig`, `quantkit.load`, a
benchmark) and handed to what launches kernels (the engine's layers and KV pool, each QuantLinear).
`from_env` is the one reader of QUANTKIT_KERNEL, _DECODE_KERNEL, _GLUON, _PDL and _DISPATCH_TABLE
(kernels/README.md says what each does)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Mapping, Optional

import torch

from quantkit.config import UserError
from quantkit.kernels.hardware import mma_capable


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    path: str = "auto"             # "auto", "triton" or "reference"
    decode: str = "auto"           # "auto", "dot" or "rows"
    gluon: bool = True
    pdl: bool = False
    table: Optional[str] = None    # a JSON file of dispatch-table rows

    def __post_init__(self) -> None:
        for value, allowed, variable in ((self.path, ("auto", "triton", "reference"), "QUANTKIT_KERNEL"),
                                         (self.decode, ("auto", "dot", "rows"), "QUANTKIT_DECODE_KERNEL")):
            if value not in allowed:
                raise UserError(f"{variable}={value}: use {', '.join(allowed)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "KernelSettings":
        """The settings the QUANTKIT_* variables ask for (unset: the defaults)."""
        word = {name: env.get(f"QUANTKIT_{name}", "").strip().lower() for name in ("KERNEL", "DECODE_KERNEL",
                                                                                    "GLUON", "PDL")}
        return cls(word["KERNEL"] or "auto", word["DECODE_KERNEL"] or "auto", word["GLUON"] != "0",
                   word["PDL"] == "1", env.get("QUANTKIT_DISPATCH_TABLE") or None)

    def triton(self, device: torch.device) -> bool:
        """Whether the Triton kernels run for tensors on `device` (else the torch reference). TRITON_INTERPRET
        alone does not switch: the kernel tests set it for a whole session, whose engine tests keep "auto"."""
        return self.path == "triton" if self.path != "auto" else mma_capable(device)

    def dispatch_rows(self) -> dict:
        """The dispatch table (dispatch_table.TABLE), with the rows of `table` in place of its classes'."""
        return _table_with(self.table)


AUTO = KernelSettings()


@functools.lru_cache(maxsize=8)
def _table_with(path: Optional[str]) -> dict:
    from quantkit.kernels.dispatch_table import TABLE, replaced_rows

    if path is None:
        return TABLE
    source = f"QUANTKIT_DISPATCH_TABLE={path}"
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{source}: cannot read it as JSON ({e}); point it at a table "
                        f"bench/kernel_speed.py --tune wrote, or unset it.") from None
    if not isinstance(table, dict):
        raise UserError(f"{source}: expected an object of classes to rows, e.g. {{\"w4 block-planar\": [...]}}.")
    return replaced_rows(TABLE, table, source)

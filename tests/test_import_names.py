"""Names that are ours stay ours: no top-level name that the tests or the benchmarks put on `sys.path` may
be the import name of an installed distribution or of the standard library. (transformers 5.25 began to
require Hugging Face's `kernels`; tests/kernels on the path then hid it, and bench/kernels.py shadowed it.)

The folders that reach `sys.path`: pyproject's pytest `pythonpath` (tests/support), and the repository
root, which `python -m pytest` and `python -m bench.NAME` put first and every bench script puts first when
run as a file (tests/test_bench_scripts.py runs them both ways)."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def top_level_names(folder: Path) -> set[str]:
    """What `import NAME` can find in `folder`: modules, packages and folders (namespace packages)."""
    names = set()
    for entry in folder.iterdir():
        name = entry.stem if entry.suffix == ".py" and entry.is_file() else entry.name
        if entry.is_dir() and not name.isidentifier():
            continue  # .git, quantkit.egg-info, ...: not importable
        if entry.is_file() and entry.suffix != ".py":
            continue
        if name.isidentifier() and not name.startswith("__"):
            names.add(name)
    return names


def taken_names(own_distribution: str = "quantkit") -> dict[str, list[str]]:
    """Import name → the installed distributions (or "the standard library") that provide it."""
    taken = {name: ["the standard library"] for name in sys.stdlib_module_names}
    for name, dists in importlib.metadata.packages_distributions().items():
        others = [d for d in dists if d.lower() != own_distribution]
        if others:
            taken.setdefault(name, []).extend(others)
    return taken


def collisions(folders: list[Path], taken: dict[str, list[str]]) -> list[str]:
    return sorted(f"{folder.relative_to(ROOT) if folder != ROOT else '.'}/{name}: also {', '.join(taken[name])}"
                  for folder in folders for name in top_level_names(folder) if name in taken)


def our_path_folders() -> list[Path]:
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return [ROOT] + [ROOT / p for p in pytest_options["pythonpath"]]


def test_no_name_we_put_on_the_path_is_taken():
    found = collisions(our_path_folders(), taken_names())
    assert not found, ("a top-level name of ours is also installed (rename ours; tests/support should hold the "
                       "quantkit_testing package only):\n" + "\n".join(found))


def test_tests_folder_itself_is_not_on_the_path():
    # tests/ holds kernels/, models/, server/, eval/...: on the path they would hide (or, as namespace
    # packages found by importlib.util.find_spec, pretend to be) distributions of those names.
    assert ROOT / "tests" not in our_path_folders()
    assert top_level_names(ROOT / "tests" / "support") == {"quantkit_testing"}


def test_the_check_finds_a_collision(tmp_path, monkeypatch):
    (tmp_path / "json.py").write_text("")          # the standard library's
    (tmp_path / "kernels").mkdir()                 # a folder: a namespace package
    (tmp_path / "ours_only.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path.parent)
    taken = {"json": ["the standard library"], "kernels": ["kernels"]}
    found = collisions([tmp_path], taken)
    assert [line.split(":")[0].rsplit("/", 1)[1] for line in found] == ["json", "kernels"]
    assert "ours_only" in top_level_names(tmp_path) and "notes" not in top_level_names(tmp_path)

"""Decoder blocks read from the checkpoint when their turn comes, so a model larger than host memory loads.

The model is built with empty (meta) parameters; the tensors outside the decoder blocks (embeddings,
final norm, lm_head) are read at once, and each block's tensors only when a block-by-block pass asks
for them (`LazyBlocks.load`), to be dropped again once that block is done (`release`). Safetensors
files are read through `safe_open`, which maps the file: the host holds the pages of the block being
read, not the file. `pytorch_model*.bin` files are opened with `torch.load(mmap=True)` to the same end.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from quantkit.config import UserError

log = logging.getLogger(__name__)

Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class WeightsMismatch(UserError):
    """The checkpoint's tensor names or shapes do not match the model its config describes."""


class TensorReader:
    """Tensors of a checkpoint directory by name, read from whichever file holds them."""

    def __init__(self, path: Path, skip: tuple[str, ...] = ()) -> None:
        """`skip`: names of .safetensors files in `path` that hold no weights."""
        self.path = Path(path)
        self.file_of: dict[str, Path] = {}
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}
        files = sorted(f for f in self.path.glob("*.safetensors") if f.name not in skip)
        if files:
            from safetensors import SafetensorError, safe_open

            for f in files:
                try:
                    with safe_open(str(f), "pt") as handle:
                        for name in handle.keys():
                            self.file_of[name] = f
                except (SafetensorError, OSError) as exc:  # a cut-off download or copy: say which file
                    raise WeightsMismatch(f"{f} is truncated or corrupt ({exc}); download or re-create "
                                          "it".replace("\n", " ")) from None
            return
        for f in sorted(self.path.glob("pytorch_model*.bin")):
            try:  # mmap=True: the tensors are views of the file, read when touched
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (pre-zip) format cannot be mapped: read whole
                sd = torch.load(f, map_location="cpu", weights_only=True)
            self._bins[f] = sd
            for name in sd:
                self.file_of[name] = f
        if not self.file_of:
            raise WeightsMismatch(f"{self.path} has a config.json but no *.safetensors or pytorch_model*.bin weights")

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header (no data read)."""
        f = self.file_of[name]
        if f in self._bins:
            return tuple(self._bins[f][name].shape)
        from safetensors import safe_open

        with safe_open(str(f), "pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors; each safetensors file is opened once per call and closed after."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for f, wanted in by_file.items():
            if f in self._bins:
                out.update({n: self._bins[f][n] for n in wanted})
                continue
            from safetensors import safe_open

            with safe_open(str(f), "pt") as handle:
                out.update({n: handle.get_tensor(n) for n in wanted})
        return out


def _assign(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Put `tensors` (names relative to `module`) in place of its parameters, checking names and shapes."""
    own = dict(module.named_parameters())
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = [n for n in own if n in tensors and tuple(tensors[n].shape) != tuple(own[n].shape)]
    if missing or unexpected or wrong:
        raise WeightsMismatch(
            f"{where}: the checkpoint's tensors do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}); is config.json the one of these weights?")
    module.load_state_dict(tensors, strict=True, assign=True)


class BlockWeights:
    """Where a block-by-block pass gets each decoder block's weights from, and what it does with them after.

    This base class is for a model whose weights are already in memory: loading does nothing, and
    `release` moves the block back to the host in its stored dtype, or, with `drop=True` (a model the
    pass owns), frees the block's tensors.
    """

    def __init__(self, drop: bool = False) -> None:
        self.drop = drop

    def load(self, index: int, layer: torch.nn.Module) -> None:
        pass

    def release(self, index: int, layer: torch.nn.Module, dtype: torch.dtype) -> None:
        if self.drop:
            layer.to("meta")
        else:
            layer.to(device="cpu", dtype=dtype)


class LazyBlocks(BlockWeights):
    """Blocks read from the checkpoint just before their turn and dropped after it."""

    def __init__(self, reader: TensorReader, layers_path: str, dtype: torch.dtype, convert: Optional[Convert] = None,
                 source_prefix: Optional[str] = None) -> None:
        super().__init__(drop=True)
        self.reader, self.layers_path, self.dtype = reader, layers_path, dtype
        self.convert = convert or (lambda sd: sd)
        self.source_prefix = source_prefix or layers_path
        self.loads: list[int] = []  # the order blocks were read in (tests look at it)

    def block_names(self, index: int) -> list[str]:
        prefix = f"{self.source_prefix}.{index}."
        return [n for n in self.reader.names() if n.startswith(prefix)]

    def load(self, index: int, layer: torch.nn.Module) -> None:
        sd = self.convert(self.reader.read(self.block_names(index)))
        prefix = f"{self.layers_path}.{index}."
        block = {n[len(prefix):]: t.to(self.dtype) for n, t in sd.items() if n.startswith(prefix)}
        _assign(layer, block, f"{self.reader.path} block {index}")
        self.loads.append(index)

    def release(self, index: int, layer: torch.nn.Module, dtype: torch.dtype) -> None:
        layer.to("meta")


def build_lazy_model(config, reader: TensorReader, layers_path: str, dtype: torch.dtype,
                     convert: Optional[Convert] = None, generation_dir: Optional[Path] = None,
                     source_layers_path: Optional[str] = None):
    """A causal LM for `config` whose decoder blocks are empty (meta) and every other tensor is read.

    `source_layers_path` names the blocks in the checkpoint when it differs from the model's `layers_path`
    (a converted family). Returns (model, LazyBlocks). Buffers (rotary frequencies) are built for real on
    the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    convert_given, convert = convert, convert or (lambda sd: sd)
    block_prefix = f"{layers_path}."
    source_block_prefix = f"{source_layers_path or layers_path}."
    stem = convert(reader.read(n for n in reader.names() if not n.startswith(source_block_prefix)))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        stem.pop("lm_head.weight", None)
    wanted = {n for n, _ in model.named_parameters() if not n.startswith(block_prefix)}
    if tied:
        wanted.discard("lm_head.weight")
    missing = sorted(wanted - set(stem))
    if missing:
        raise WeightsMismatch(f"{reader.path}: the checkpoint lacks {missing[:3]}; is config.json the one of these weights?")
    params = {n: stem[n].to(dtype) for n in wanted}
    model.load_state_dict(params, strict=False, assign=True)
    if tied:
        model.tie_weights()
    if generation_dir is not None and (Path(generation_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(generation_dir))
    blocks = LazyBlocks(reader, layers_path, dtype, convert, source_prefix=source_layers_path)
    if convert_given is None:  # names map one to one: check every block now, not when the pass reaches it
        expected = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(block_prefix)}
        found = {n: reader.shape(n) for n in reader.names() if n.startswith(block_prefix)}
        if expected != found:
            wrong = sorted(n for n in expected.keys() | found.keys() if expected.get(n) != found.get(n))
            raise WeightsMismatch(f"{reader.path}: the checkpoint's decoder blocks do not match its config.json "
                                  f"({len(wrong)} tensors differ in name or shape, e.g. {wrong[:2]})")
    return model.eval(), blocks


def load_all_blocks(model: torch.nn.Module, blocks: LazyBlocks) -> torch.nn.Module:
    """Read every block now (for callers that want the whole model in memory)."""
    for i, layer in enumerate(model.get_submodule(blocks.layers_path)):
        blocks.load(i, layer)
    blocks.loads.clear()
    return model

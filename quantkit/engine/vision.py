"""The image half of a LLaVA checkpoint for the engine: its processor and its vision tower + projector.

Both are transformers' own code built from the checkpoint's files (no remote code): the processor
(LlavaProcessor / LlavaNextProcessor from processor_config.json / preprocessor_config.json: resizing,
LLaVA-NeXT's any-resolution tiling, one `<image>` expanded into as many placeholder tokens as the
image has features) and `get_image_features` of a LlavaModel / LlavaNextModel whose language model is
left empty (meta tensors: the engine's decoder is the language model). `encode` turns chat messages
with images into a `MultiModalPrompt`: token ids and the features that replace the placeholders.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.config import UserError
from quantkit.engine.images import LOCAL_USER, ImageError, ImagePolicy, load_image
from quantkit.engine.multimodal import ImageInputs, MultiModalPrompt, pixel_hash
from quantkit.models.lazy import TensorReader
from quantkit.models.loading import ModelLoadError, read_config_json, transformers_config
from quantkit.models.registry import spec_for_config

log = logging.getLogger(__name__)

# The language model's tensors in a llava-hf checkpoint; everything else belongs to the image half.
LANGUAGE_PREFIX = "language_model."
# Without a chat template in the processor: LLaVA-1.5's conversation format.
FALLBACK_ROLES = {"user": "USER", "assistant": "ASSISTANT", "system": ""}


class NoImagesError(UserError):
    """Images were sent to a model that takes none."""


def is_vision_checkpoint(path: Path) -> bool:
    return bool(spec_for_config(read_config_json(path)).vision)


def _vision_model(path: Path, config: Any, device: torch.device, dtype: torch.dtype):
    """A LlavaModel / LlavaNextModel with its vision tower, projector and image_newline read from `path`
    and its language model left on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoModel

    with init_empty_weights(include_buffers=False):
        model = AutoModel.from_config(config)
    own = {n for n, _ in model.named_parameters() if not n.startswith("language_model.")}
    reader = TensorReader(path)
    names = [n for n in reader.names() if not n.startswith(LANGUAGE_PREFIX)]
    tensors = {}
    for name, t in reader.read(names).items():
        # llava-hf names CLIP's modules vision_tower.vision_model.…; transformers 5 builds them without it.
        candidates = (name, name.replace("vision_tower.vision_model.", "vision_tower.", 1), name.removeprefix("model."))
        target = next((c for c in candidates if c in own), None)
        if target is not None:
            tensors[target] = t.to(dtype)
    missing = sorted(own - set(tensors))
    if missing:
        raise ModelLoadError(f"{path}: the checkpoint lacks the vision tensors {missing[:3]}; is config.json the "
                             "one of these weights?")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.language_model = None  # never run: the engine's decoder is the language model
    return model.to(device).eval().requires_grad_(False)


class VisionEncoder:
    """Chat messages with images → `MultiModalPrompt` (token ids + image features), see the module docstring."""

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, processor: Any) -> None:
        self.path, self.device, self.dtype, self.processor = path, device, dtype, processor
        self.config = transformers_config(path)
        self.model = _vision_model(path, self.config, device, dtype)
        self.image_token_id = int(getattr(self.config, "image_token_id", None) or self.config.image_token_index)
        self.image_token = getattr(self.processor, "image_token", "<image>")

    @property
    def chat_template(self) -> Optional[str]:
        return getattr(self.processor, "chat_template", None)

    def _conversation(self, messages: list[dict], policy: ImagePolicy) -> tuple[list[dict], list]:
        """Messages with their image parts loaded (in order) and replaced by {"type": "image"} markers."""
        conversation, images = [], []
        for message in messages:
            content = message.get("content")
            if content is None or isinstance(content, str):
                parts = [{"type": "text", "text": content or ""}]
            elif isinstance(content, (list, tuple)):
                parts = []
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text":
                        parts.append({"type": "text", "text": part.get("text", "")})
                    elif kind in ("image_url", "image"):
                        source = part.get("image_url", part.get("image", part.get("url")))
                        if isinstance(source, dict):
                            source = source.get("url")
                        images.append(load_image(source, policy))
                        parts.append({"type": "image"})
                    else:
                        raise UserError(f"unknown content part {part!r}: use {{'type': 'text', 'text': …}} or "
                                        "{'type': 'image_url', 'image_url': {'url': …}}")
            else:
                raise UserError(f"a message's content is a string or a list of parts, not {type(content).__name__}")
            conversation.append({"role": message.get("role", "user"), "content": parts})
        return conversation, images

    def _prompt_text(self, conversation: list[dict]) -> str:
        if self.chat_template:
            return self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        lines = []
        for m in conversation:
            images = sum(p["type"] == "image" for p in m["content"])
            text = "".join(p.get("text", "") for p in m["content"] if p["type"] == "text")
            role = FALLBACK_ROLES.get(m["role"], m["role"].upper())
            lines.append(f"{role + ': ' if role else ''}{(self.image_token + chr(10)) * images}{text}")
        return " ".join(lines) + " ASSISTANT:"

    @torch.no_grad()
    def features(self, inputs: dict) -> torch.Tensor:
        """The projected features [P, hidden] of the processor's `pixel_values` (+ `image_sizes`), in order."""
        kwargs = {"pixel_values": inputs["pixel_values"].to(self.device, self.dtype)}
        if "image_sizes" in inputs:
            kwargs["image_sizes"] = inputs["image_sizes"].to(self.device)
        out = self.model.get_image_features(**kwargs, return_dict=True)
        return torch.cat(list(out["pooler_output"]), dim=0)  # a ModelOutput is a dict too

    def encode(self, messages: list[dict], policy: ImagePolicy = LOCAL_USER) -> MultiModalPrompt:
        """Chat messages (content a string or OpenAI-style parts: text, image_url, image) → token ids with the
        image placeholders expanded, and the features that go there. Images are paths, PIL images, data:
        URLs, or http(s) URLs, read as `policy` allows (a local user's by default: files and downloads)."""
        conversation, images = self._conversation(messages, policy)
        text = self._prompt_text(conversation)
        try:
            inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise ImageError(f"the image processor refused the prompt: {str(exc).splitlines()[0]}") from None
        ids = inputs["input_ids"][0]
        positions = (ids == self.image_token_id).nonzero().flatten().tolist()
        if not images:
            if positions:
                raise UserError(f"the prompt holds {len(positions)} image tokens ({self.image_token}) but no image")
            return MultiModalPrompt(ids.tolist())
        embeds = self.features(inputs)
        if embeds.shape[0] != len(positions):
            raise UserError(f"the prompt has {len(positions)} image tokens for {embeds.shape[0]} image features: "
                            f"write no {self.image_token} of your own in the text")
        hashed = [inputs["pixel_values"]] + ([inputs["image_sizes"]] if "image_sizes" in inputs else [])
        return MultiModalPrompt(ids.tolist(), ImageInputs(positions, embeds, pixel_hash(hashed)))


def load_vision(path: str | Path, device: torch.device, dtype: torch.dtype) -> Optional[VisionEncoder]:
    """The image half of a checkpoint whose registry entry takes images (LLaVA), else None."""
    from transformers import AutoProcessor

    path = Path(path)
    if not path.is_dir() or not is_vision_checkpoint(path):
        return None
    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:  # text still works: say why images will not
        log.warning("%s has no usable image processor (%s): it answers text only; copy the original model's "
                    "preprocessor_config.json / processor_config.json beside it to send images",
                    path, str(exc).splitlines()[0][:200])
        return None
    return VisionEncoder(path, device, dtype, processor)


def has_images(prompt: Any) -> bool:
    """Whether chat messages hold an image part."""
    if not isinstance(prompt, (list, tuple)) or not prompt or not isinstance(prompt[0], dict):
        return False
    return any(isinstance(part, dict) and part.get("type") in ("image_url", "image")
               for m in prompt if isinstance(m.get("content"), (list, tuple)) for part in m["content"])

"""Tiny random LLaVA and LLaVA-NeXT checkpoints in the llava-hf layout, with a processor (no download).

A tiny CLIP vision tower (56-pixel images in 14-pixel patches: 16 features per image tile) and a tiny
Llama language model, saved as llava-hf publishes them: fp16 tensors named `language_model.model.…`,
`language_model.lm_head`, `vision_tower.vision_model.…`, `multi_modal_projector.…` (and NeXT's
`image_newline`), a tokenizer with an `<image>` token, the processor's files and a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from quantkit_testing.tiny import TINY, make_tokenizer

IMAGE_SIZE = 56
PATCH = 14
PINPOINTS = [[56, 112], [112, 56], [112, 112]]
# LLaVA-1.5's conversation format, as llava-hf's processors template it: images first in a turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{{ ' ' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def llava_config(next_: bool, text: dict | None = None):
    """The tiny config; `text` overrides fields of the Llama text config (TINY's shapes by default)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaNextConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=16)
    text = LlamaConfig(**{**TINY, **(text or {})})
    common = dict(vision_config=vision, text_config=text, image_token_id=300, vision_feature_layer=-2,
                  vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False)
    if next_:
        return LlavaNextConfig(**common, image_grid_pinpoints=PINPOINTS)
    return LlavaConfig(**common)


def make_llava(next_: bool, seed: int = 0, text: dict | None = None):
    from transformers import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    cls = LlavaNextForConditionalGeneration if next_ else LlavaForConditionalGeneration
    model = cls(llava_config(next_, text)).eval()
    # Spread the weights (as tests/support/quantkit_testing/tiny.py does) so that the image changes the answer.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "vision_tower" in name and "embedding" in name:
                p.normal_(0, 0.5)
            elif p.ndim == 2:
                p.normal_(0, 0.08 if "language_model" in name or "lm_head" in name else 0.2)
            else:
                p.normal_(0, 0.1)
    return model


def make_processor(next_: bool):
    from transformers import CLIPImageProcessor, LlavaNextImageProcessor, LlavaNextProcessor, LlavaProcessor

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == 300
    size, crop = {"shortest_edge": IMAGE_SIZE}, {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    if next_:
        ip = LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=PINPOINTS)
        return LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH, chat_template=CHAT_TEMPLATE,
                                  vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)
    ip = CLIPImageProcessor(size=size, crop_size=crop)
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH, chat_template=CHAT_TEMPLATE,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)


def to_llava_hf_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's saved names → llava-hf's (CLIP under `vision_tower.vision_model.`)."""
    out = {}
    for name, t in sd.items():
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        out[name] = t
    return out


def write_tiny_llava(directory: Path, next_: bool = False, seed: int = 0, text: dict | None = None) -> Path:
    """A tiny llava-hf checkpoint (fp16) with its processor; returns `directory`. `text`: see llava_config."""
    from safetensors.torch import load_file, save_file

    model = make_llava(next_, seed, text)
    model.half().save_pretrained(str(directory))
    sd = load_file(str(directory / "model.safetensors"))
    hf = to_llava_hf_names(sd)
    assert any(n.startswith("vision_tower.vision_model.encoder.layers.1.") for n in hf)
    assert any(n.startswith("language_model.model.layers.1.") for n in hf) and "language_model.lm_head.weight" in hf
    save_file(hf, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["image_token_index"] = cfg.pop("image_token_id", cfg.get("image_token_index"))  # llava-hf's spelling
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    make_processor(next_).save_pretrained(str(directory))
    return directory


def make_image(seed: int, size: tuple[int, int] = (40, 70)):
    """A random RGB PIL image of (height, width)."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(*size, 3) * 255).astype("uint8"))


def png_header_only(width: int, height: int, data: bytes = b"") -> bytes:
    """A PNG whose header says width × height (8-bit grey) and whose compressed pixel data is `data` (a few
    rows by default): a decompression bomb's shape, a few hundred bytes that claim any size."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = data or zlib.compress(b"\0" * (width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def data_url(image_or_bytes) -> str:
    """A data:image/png;base64 URL of a PIL image (saved as PNG) or of bytes as they are."""
    import base64
    import io

    data = image_or_bytes
    if not isinstance(data, bytes):
        buf = io.BytesIO()
        image_or_bytes.save(buf, format="PNG")
        data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages(text: str, n_images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]

"""`load_image`: an image from a path, a PIL image, a data: URL or (when online) an http(s) URL, as RGB."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from quantkit.config import UserError

DOWNLOAD_TIMEOUT_S = 10


class ImageError(UserError):
    """An image that cannot be read: the message says which and why."""


def _open(data: bytes, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(f"{what} is not an image PIL can read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return image


def _data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: URL image must be base64-encoded: data:image/png;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's image is not valid base64") from None


def _download(url: str) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            return response.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageError(f"cannot download {url} ({reason}); offline, pass a local file path or a data: URL "
                         "instead") from None


def load_image(image: Any, allow_download: bool = True):
    """A PIL image in RGB from a file path, a PIL image, a data: URL (data:image/png;base64,…) or an
    http(s) URL (downloaded unless `allow_download` is False). Errors are one-line `ImageError`s."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, Path):
        image = str(image)
    if not isinstance(image, str):
        raise ImageError(f"an image is a file path, a PIL image or a data:/http(s) URL, not {type(image).__name__}")
    if image.startswith("data:"):
        return _open(_data_url(image), "the data: URL").convert("RGB")
    if image.startswith(("http://", "https://")):
        if not allow_download:
            raise ImageError(f"images are not downloaded here ({image[:80]}): pass a data: URL or a local file path")
        return _open(_download(image), image).convert("RGB")
    path = Path(image.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise ImageError(f"image file {path} does not exist")
    return _open(path.read_bytes(), str(path)).convert("RGB")

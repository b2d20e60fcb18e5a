"""`load_image`: an image from a path, a PIL image, a data: URL or (when allowed) an http(s) URL, as RGB,
under an `ImagePolicy`: where images may come from and how large they may be.

A local user (the Python API, `quantkit chat`) reads any file and downloads. A server (`ImagePolicy.served`)
downloads nothing, reads local files only under its media root (resolved: no `..` or symlink way out),
answers the same sentence for every local path it will not read, so that a client learns nothing of the
server's files, and bounds decoding: the encoded bytes before they are decoded, width × height from the
header before the pixels are, and only the common formats.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from quantkit.config import UserError

DOWNLOAD_TIMEOUT_S = 10
DEFAULT_MAX_IMAGE_BYTES = 10 * 2**20   # as a data: URL (4/3 as long) it fits serve's 16 MiB request body
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000
# What a server decodes: the formats clients send. PIL reads many more (EPS runs Ghostscript).
SERVED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(UserError):
    """An image that cannot be read: the message says which and why."""


@dataclass(frozen=True)
class ImagePolicy:
    """Where `load_image` may read an image from and how large it may be (None: no cap of ours; PIL's own
    decompression-bomb limit still holds). The default is a local user's."""

    local_files: bool = True                  # file paths and file:// URLs
    media_root: Optional[str] = None          # set: local files only under this directory, relative to it
    download: bool = True                     # fetch http(s) URLs
    max_bytes: Optional[int] = None           # an image's encoded size (a file's, a data: URL's decoded)
    max_pixels: Optional[int] = None          # width × height, read from the header before decoding
    formats: Optional[tuple[str, ...]] = None  # PIL's format names accepted (None: any PIL reads)

    @classmethod
    def served(cls, media_root: Optional[str] = None, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
               max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> "ImagePolicy":
        """A server's: data: URLs, and local files only under `media_root` (none without it); no download."""
        return cls(local_files=media_root is not None, media_root=media_root, download=False,
                   max_bytes=max_bytes, max_pixels=max_pixels, formats=SERVED_FORMATS)


LOCAL_USER = ImagePolicy()


def _shown(text: str) -> str:
    return repr(text if len(text) <= 200 else text[:200] + "…")


def _check_bytes(size: int, what: str, policy: ImagePolicy) -> None:
    if policy.max_bytes is not None and size > policy.max_bytes:
        raise ImageError(f"{what} is {size:,} bytes, over the limit of {policy.max_bytes:,} bytes an image may "
                         "have here (--max-image-bytes): send a smaller image")


def _too_many_pixels(what: str, pixels: str, limit: int) -> ImageError:
    return ImageError(f"{what} has {pixels} pixels, over the limit of {limit:,} an image may have here "
                      "(--max-image-pixels): send a smaller image")


def _open(data: bytes, what: str, policy: ImagePolicy):
    from PIL import Image, UnidentifiedImageError

    try:
        # Reads the header only. Past PIL's own limit it raises DecompressionBombError; between half that
        # and that it warns, and our cap (below it by default) refuses the image next.
        image = Image.open(io.BytesIO(data), formats=policy.formats)
        width, height = image.size
        if policy.max_pixels is not None and width * height > policy.max_pixels:
            raise _too_many_pixels(what, f"{width}x{height}", policy.max_pixels)
        image.load()
        return image.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:
        pil_limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        if policy.max_pixels is not None:
            raise _too_many_pixels(what, f"more than {pil_limit:,}", min(policy.max_pixels, pil_limit)) from None
        raise ImageError(f"{what} has more than {pil_limit:,} pixels, PIL's decompression-bomb limit: send a "
                         "smaller image") from None
    except UnidentifiedImageError:
        kinds = f" ({', '.join(policy.formats)})" if policy.formats else ""
        raise ImageError(f"{what} is not an image{kinds} PIL can read") from None
    except Exception as exc:  # untrusted bytes: whatever the decoder raises is this image's fault
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageError(f"{what} is not an image PIL can read ({reason[:200]})") from None


def _data_url(url: str, policy: ImagePolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: URL image must be base64-encoded: data:image/png;base64,<data>")
    if policy.max_bytes is not None and len(payload) > 4 * -(-policy.max_bytes // 3):  # before decoding
        _check_bytes(len(payload) * 3 // 4, "the data: URL's image", policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's image is not valid base64") from None
    _check_bytes(len(data), "the data: URL's image", policy)
    return data


def _download(url: str, policy: ImagePolicy) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read() if policy.max_bytes is None else response.read(policy.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageError(f"cannot download {url} ({reason}); offline, pass a local file path or a data: URL "
                         "instead") from None
    _check_bytes(len(data), url, policy)
    return data


def _file_path(image: str) -> str:
    """A path, or a file:// URL's path (file:///abs/path or file://localhost/abs/path, %-escapes decoded)."""
    if not image.startswith("file://"):
        return image
    rest = image[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return urllib.parse.unquote(rest)


def _read_under_root(image: str, root: str, policy: ImagePolicy) -> bytes:
    """The bytes of a regular file under `root` after resolving; one sentence for every other path (missing,
    outside, a directory, unreadable) so that the answer says nothing of what exists outside."""
    refused = ImageError(f"cannot read image {_shown(image)}: local images are read only under "
                         "--allowed-local-media-path, and this one is not a readable image file there")
    try:
        root = os.path.realpath(root)
        path = os.path.realpath(os.path.join(root, _file_path(image)))
        if os.path.commonpath([root, path]) != root:
            raise refused
        # O_NOFOLLOW: a symlink put in place of the resolved file since is not followed.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):
        raise refused from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refused
        _check_bytes(info.st_size, f"image {_shown(image)}", policy)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read() if policy.max_bytes is None else file.read(policy.max_bytes + 1)
        _check_bytes(len(data), f"image {_shown(image)}", policy)   # it may have grown since
        return data
    except OSError:
        raise refused from None
    finally:
        os.close(fd)


def _read_local(image: str, policy: ImagePolicy) -> bytes:
    if not policy.local_files:
        raise ImageError(f"cannot read image {_shown(image)}: this server reads no local files (start it with "
                         "--allowed-local-media-path DIR for that); send the image as a data: URL")
    if policy.media_root is not None:
        return _read_under_root(image, policy.media_root, policy)
    path = Path(_file_path(image)).expanduser()
    if not path.is_file():
        raise ImageError(f"image file {path} does not exist")
    try:
        _check_bytes(path.stat().st_size, str(path), policy)
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image file {path} ({exc.strerror or exc})") from None


def load_image(image: Any, policy: ImagePolicy = LOCAL_USER):
    """A PIL image in RGB from a file path or file:// URL, a PIL image, a data: URL (data:image/png;base64,…)
    or an http(s) URL, as `policy` allows (by default: any local file, and downloads). Errors are one-line
    `ImageError`s."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, Path):
        image = str(image)
    if not isinstance(image, str):
        raise ImageError(f"an image is a file path, a PIL image or a data:/http(s) URL, not {type(image).__name__}")
    if image.startswith("data:"):
        return _open(_data_url(image, policy), "the data: URL", policy)
    if image.startswith(("http://", "https://")):
        if not policy.download:
            raise ImageError(f"images are not downloaded here ({image[:80]}): send a data: URL"
                             + (" or a local file path" if policy.local_files else ""))
        return _open(_download(image, policy), image, policy)
    return _open(_read_local(image, policy), f"image {_shown(image)}", policy)

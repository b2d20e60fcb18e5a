"""load_image under an ImagePolicy: a local user's reads every source; a server's reads data: URLs, and
local files only under its media root with one answer for every path it will not read; sizes are
checked before decoding, and whatever PIL refuses is a one-line ImageError."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from quantkit.engine.images import ImageError, ImagePolicy, load_image
from quantkit_testing.tiny_llava import data_url, make_image, png_header_only


def _refusal(source, policy: ImagePolicy) -> str:
    with pytest.raises(ImageError) as info:
        load_image(source, policy)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_local_user_reads_every_source(tmp_path):
    image = make_image(5)
    pixels = np.asarray(image)
    path = tmp_path / "tiger.png"
    image.save(path)
    url = data_url(image)
    for source in (str(path), path, f"file://{path}", f"file://localhost{path}", image,
                   image.convert("L").convert("RGB"), url):
        loaded = load_image(source)
        assert loaded.mode == "RGB" and loaded.size == image.size
        if source is not image and not isinstance(source, type(image)):
            assert np.array_equal(np.asarray(loaded), pixels)
    assert load_image(image.convert("RGBA")).mode == "RGB"
    image.save(tmp_path / "tiger.tiff")   # a format a server does not read
    assert np.array_equal(np.asarray(load_image(tmp_path / "tiger.tiff")), pixels)
    for bad, words in ((tmp_path / "missing.png", "does not exist"), ("data:image/png,abc", "base64-encoded"),
                       ("data:image/png;base64,@@", "not valid base64"), (3, "not int"),
                       (data_url(b"text"), "not an image")):
        with pytest.raises(ImageError, match=words):
            load_image(bad)
    with pytest.raises(ImageError, match="not downloaded"):
        load_image("https://example.com/tiger.jpeg", ImagePolicy(download=False))


@pytest.fixture
def media(tmp_path):
    """root/ with an image, a sub-directory, a FIFO and symlinks in and out; an image outside root/."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    make_image(1, (60, 50)).save(root / "inside.png")
    make_image(2).save(tmp_path / "secret.png")
    (root / "alias.png").symlink_to(root / "inside.png")
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "up").symlink_to(tmp_path)
    os.mkfifo(root / "pipe.png")
    return root


def test_a_server_reads_no_local_file_without_a_root(media):
    served = ImagePolicy.served()
    for source in (str(media / "inside.png"), f"file://{media / 'inside.png'}", "inside.png", "/nonexistent/x.png"):
        message = _refusal(source, served)
        assert "reads no local files" in message and "--allowed-local-media-path" in message
    assert "not downloaded" in _refusal("https://example.com/tiger.jpeg", served)
    assert load_image(data_url(make_image(3)), served).size == make_image(3).size


def test_a_server_reads_files_under_its_root_only(media):
    served = ImagePolicy.served(str(media))
    want = np.asarray(make_image(1, (60, 50)))
    for source in (str(media / "inside.png"), "inside.png", "sub/../inside.png", f"file://{media / 'inside.png'}",
                   f"file://localhost{media / 'inside.png'}", str(media / "alias.png")):
        assert np.array_equal(np.asarray(load_image(source, served)), want), source

    outside = str(media.parent / "secret.png")
    refused = [outside, f"file://{outside}", "escape.png", str(media / "escape.png"), "up/secret.png",
               "../secret.png", str(media / ".." / "secret.png"), f"file://{media}/../secret.png",
               "missing.png", str(media / "missing.png"), "/nonexistent/x.png", "sub", str(media), "pipe.png",
               "/etc/passwd", "bad\0byte.png"]
    if os.geteuid() != 0:   # root reads a file whatever its mode
        make_image(4).save(media / "locked.png")
        (media / "locked.png").chmod(0)
        refused.append("locked.png")
    messages = {_refusal(source, served).replace(repr(source), "PATH") for source in refused}
    # One sentence for all: a client learns nothing of what exists on the server.
    assert messages == {("cannot read image PATH: local images are read only under --allowed-local-media-path, "
                         "and this one is not a readable image file there")}


def test_sizes_are_checked_before_decoding(media):
    served = ImagePolicy.served(str(media), max_bytes=1000, max_pixels=50 * 50)
    # Not base64 at all, but too long: refused for its size before it is decoded.
    assert "over the limit of 1,000 bytes" in _refusal("data:image/png;base64," + "@" * 2000, served)
    assert "over the limit of 1,000 bytes" in _refusal(data_url(os.urandom(1001)), served)
    assert "over the limit of 1,000 bytes" in _refusal("inside.png", served)   # a file: its size, unread
    assert "50x60 pixels, over the limit of 2,500" in _refusal(data_url(make_image(1, (60, 50))),
                                                               ImagePolicy.served(max_pixels=2500))
    default = ImagePolicy.served()
    with warnings.catch_warnings():   # PIL warns of a bomb past half its own limit (10000x10000)
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        for width, height in ((6000, 6000), (10000, 10000)):
            message = _refusal(data_url(png_header_only(width, height)), default)
            assert f"{width}x{height} pixels, over the limit of 25,000,000 an image may have here" in message
        message = _refusal(data_url(png_header_only(30000, 30000)), default)   # past PIL's own limit
        assert "more than 178,956,970 pixels, over the limit of 25,000,000" in message
    # A local user has no cap of ours; PIL's decompression-bomb error is still a one-line ImageError.
    assert "PIL's decompression-bomb limit" in _refusal(data_url(png_header_only(30000, 30000)), ImagePolicy())
    # Under the caps, pixel data that is not zlib's is refused by the decoder, in one line.
    message = _refusal(data_url(png_header_only(300, 300, data=b"\xff" * 64)), default)
    assert "is not an image PIL can read (broken data stream" in message


def test_a_server_reads_common_formats_only(media):
    image = make_image(6)
    for fmt, read in (("PNG", True), ("JPEG", True), ("WEBP", True), ("GIF", True), ("BMP", True),
                      ("TIFF", False), ("PPM", False)):
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        url = data_url(buf.getvalue())
        assert load_image(url).size == image.size   # a local user: any format PIL reads
        if read:
            assert load_image(url, ImagePolicy.served()).size == image.size
        else:
            assert "is not an image (PNG, JPEG" in _refusal(url, ImagePolicy.served())

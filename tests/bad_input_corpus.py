"""A corpus of awkward inputs with the outcome each must have (built in a temporary folder)."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A tiny PNG file whose header claims width×height 8-bit gray pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (width + 1))
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def make_corpus(folder: Path, person: np.ndarray) -> dict[str, tuple[str, str | None]]:
    """Write the corpus; returns file name → (stage, expected reason or None for accepted).

    ``person`` is a real RGB person crop (sharp, one person), so normalised variants of it pass
    every denoise filter: unusual formats must be decoded, not rejected.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rgb = Image.fromarray(person)
    jpeg = _encode(rgb, "JPEG", quality=95)
    expected: dict[str, tuple[str, str | None]] = {}

    def put(name: str, data: bytes, stage: str, reason: str | None) -> None:
        (folder / name).write_bytes(data)
        expected[name] = (stage, reason)

    put("ok_person.jpg", jpeg, "denoise", None)
    put("行人-ñ-😀 space.jpg", _encode(rgb, "JPEG", quality=90), "denoise", None)  # unicode file name
    put("truncated.jpg", jpeg[: len(jpeg) // 2], "ingest", "corrupt_image")
    put("zero.jpg", b"", "ingest", "empty_file")
    put("notes.txt", b"this is not an image\n", "ingest", "not_an_image")
    put("text_named.jpg", b"GIF89a? no, plain text pretending", "ingest", "not_an_image")
    put("bomb.png", bomb_png(), "ingest", "decompression_bomb")
    rgba = rgb.convert("RGBA")
    rgba.putalpha(200)
    put("alpha.png", _encode(rgba, "PNG"), "denoise", None)
    put("cmyk.jpg", _encode(rgb.convert("CMYK"), "JPEG", quality=95), "denoise", None)
    gray16 = Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)
    assert gray16.mode in ("I;16", "I")
    put("gray16.png", _encode(gray16, "PNG"), "denoise", None)
    put("gray.png", _encode(rgb.convert("L"), "PNG"), "denoise", None)
    put("one_pixel.png", _encode(Image.new("RGB", (1, 1), (10, 20, 30)), "PNG"), "denoise", "too_small")
    put("duplicate_of_ok.jpg", jpeg, "denoise", "duplicate")
    return expected


# Path-list rows that name no local file, each with the reason it must get (before anything is read).
# A NUL byte would make every OS call raise; a URL joined to the list's folder would be a mangled path.
BAD_PATH_ROWS: dict[str, str] = {
    "root/ok_person.jpg\x00.png": "invalid_path",
    "\x00": "invalid_path",
    # URLs fsspec reads, but outside the list's own (local) folder: never requested
    "s3://bucket/root/ok_person.jpg": "outside_root",
    "http://example.com/ok_person.jpg": "outside_root",
    "HTTPS://example.com/ok_person.jpg": "outside_root",
    "nosuchstore://bucket/ok_person.jpg": "unsupported_url",  # no fsspec implementation
    "file:///etc/hostname": "unsupported_url",
    "file://root/ok_person.jpg": "unsupported_url",
    "s3:/bucket/ok_person.jpg": "missing_file",  # one slash: a relative local path, not a URL
}

"""Decode image bytes safely into 8-bit RGB, or say exactly why not.

Valid but unusual images (alpha, CMYK, 16-bit, grayscale, palette) are normalised to RGB so
later stages see one format; the original mode is recorded. The EXIF orientation is applied
(a phone photo held upright decodes upright), and the header reports the displayed size. Failures become a ``Reason``:
a decompression bomb is caught from the header before any pixel is decoded.
"""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from rde.common.reasons import Reason
from storage import Artifact

# Truncated files must fail, not decode half-grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False


def _pil_open() -> Callable[..., Image.Image]:
    """Pillow's own ``Image.open``.

    Importing ultralytics replaces ``PIL.Image.open`` process-wide with a wrapper that, on any
    unidentified file, tries to pip-install ``pi-heif`` and then raises ``ModuleNotFoundError``;
    that would turn "not an image" into a crash. We call the original it keeps.
    """
    opener = Image.open
    module = getattr(opener, "__module__", "") or ""
    if module.startswith("ultralytics"):
        opener = getattr(sys.modules[module], "_image_open", opener)
    return opener


EXIF_ORIENTATION = 0x0112
_SWAPS_AXES = {5, 6, 7, 8}  # orientations that rotate by 90° or 270° (with or without a mirror)


@dataclass(frozen=True)
class ImageHeader:
    """What the header says, read without decoding pixels; width and height as displayed (after
    the EXIF orientation), ``orientation`` the EXIF tag when it asks for a transform (2-8)."""

    width: int
    height: int
    mode: str
    format: str
    orientation: int | None = None


def exif_orientation(image: Image.Image) -> int | None:
    """The EXIF orientation tag when it asks for a transform (2-8), else None (absent, 1 or invalid)."""
    try:
        value = image.getexif().get(EXIF_ORIENTATION)
    except Exception:  # a broken EXIF block is not a broken image: decode it as stored
        return None
    return int(value) if isinstance(value, int) and 2 <= value <= 8 else None


class DecodeError(Exception):
    """Decoding failed with a reason code and a human-readable detail."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def read_header(data: bytes, max_pixels: int) -> ImageHeader:
    """Identify the image and check its size against ``max_pixels`` before decoding."""
    if not data:
        raise DecodeError(Reason.EMPTY_FILE, "zero bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = _pil_open()(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise DecodeError(Reason.DECOMPRESSION_BOMB, str(exc)) from None
    except UnidentifiedImageError:
        raise DecodeError(Reason.NOT_AN_IMAGE, "not a recognised image format") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(Reason.CORRUPT_IMAGE, f"unreadable header: {exc}") from None
    width, height = image.size
    orientation = exif_orientation(image)
    if orientation in _SWAPS_AXES:
        width, height = height, width
    if width * height > max_pixels:
        raise DecodeError(
            Reason.DECOMPRESSION_BOMB, f"{width}x{height} = {width * height} pixels exceeds limit {max_pixels}"
        )
    if width < 1 or height < 1:
        raise DecodeError(Reason.CORRUPT_IMAGE, f"invalid size {width}x{height}")
    return ImageHeader(width, height, image.mode, image.format or "unknown", orientation)


def decode_rgb(data: bytes, max_pixels: int = 50_000_000) -> np.ndarray:
    """Decode to an H×W×3 uint8 RGB array as displayed: EXIF orientation applied, alpha composited
    on white, 16-bit scaled to 8-bit."""
    header = read_header(data, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = _pil_open()(io.BytesIO(data))
            image.load()
            if header.orientation is not None:
                image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DecodeError(Reason.CORRUPT_IMAGE, f"decoding failed: {exc}") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> np.ndarray:
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(image, dtype=np.float64)
        hi = 65535.0 if mode.startswith("I;16") or arr.max() > 255 else 255.0
        gray = np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "F":
        arr = np.asarray(image, dtype=np.float64)
        span = float(arr.max() - arr.min()) or 1.0
        gray = ((arr - arr.min()) / span * 255.0 + 0.5).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    try:
        return np.asarray(image.convert("RGB"))
    except (OSError, ValueError) as exc:
        raise DecodeError(Reason.UNSUPPORTED_IMAGE, f"cannot convert mode {mode} to RGB: {exc}") from None


def decoded_images(artifact: Artifact, image_ids: Iterable[str]) -> dict[str, np.ndarray]:
    """The images with these ids (``image_id`` → RGB), read one shard at a time: memory is the
    selection plus one shard's bytes, not the artifact's."""
    wanted = set(image_ids)
    found: dict[str, np.ndarray] = {}
    for index, table in artifact.iter_shards(["image_id"]):  # ids first: bytes only of shards with a hit
        ids = table.column("image_id").to_pylist()
        hits = [k for k, i in enumerate(ids) if i in wanted and i not in found]
        if hits:
            column = artifact.read_shard(index, ["image_bytes"]).column("image_bytes")
            found.update((ids[k], decode_rgb(column[k].as_py())) for k in hits)
    return found


def encode_jpeg(rgb: np.ndarray, quality: int) -> bytes:
    """An RGB array as JPEG bytes at ``quality`` (OpenCV's encoder: the video crops' and the demo
    data's encoding, byte for byte the same on one build)."""
    import cv2

    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("JPEG encoding failed")
    return buf.tobytes()

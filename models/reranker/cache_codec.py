"""Compact storage of a reranker cache Z(v) (T frames × M queries × d, VEDJE Sec. "Cache").

- ``bf16``: bfloat16, exactly 2·T·M·d bytes (the paper's default); no scale.
- ``fp8``: float8 E4M3 (OCP "fn" variant, max 448) after scaling by 448 / max|Z|; T·M·d bytes plus
  a 4-byte float32 scale.
- ``fp4``: E2M1 (values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) after scaling by 6 / max|Z|, rounded to
  the nearest code, two codes per byte (first value in the low nibble); ⌈T·M·d / 2⌉ bytes plus the
  4-byte scale. Code = sign bit (3) | magnitude index (bits 0-2).

Decoding always returns float32 (scores are computed in FP32); ``decode_rows`` decodes many caches
of one shape in one vectorised call (the query-time fetch).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Precision = Literal["bf16", "fp8", "fp4"]
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP8_MAX, FP4_MAX = 448.0, 6.0


def payload_bytes(shape: tuple[int, ...], precision: Precision) -> int:
    """Bytes of the encoded values alone (without the scale)."""
    n = int(np.prod(shape))
    return {"bf16": 2 * n, "fp8": n, "fp4": (n + 1) // 2}[precision]


def _scale(z: np.ndarray, top: float) -> np.float32:
    peak = float(np.abs(z).max()) if z.size else 0.0
    return np.float32(top / peak if peak > 0 else 1.0)


def encode(z: np.ndarray, precision: Precision = "bf16") -> bytes:
    """``z`` (any shape, float) → bytes: [scale float32 (fp8/fp4 only)] + payload."""
    z = np.ascontiguousarray(z, dtype=np.float32)
    if precision == "bf16":
        return torch.from_numpy(z).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    if precision == "fp8":
        s = _scale(z, FP8_MAX)
        q = torch.from_numpy(z * s).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return s.tobytes() + q.tobytes()
    if precision == "fp4":
        s = _scale(z, FP4_MAX)
        x = (z * s).ravel()
        index = np.abs(np.abs(x)[:, None] - FP4_VALUES[None, :]).argmin(axis=1).astype(np.uint8)
        codes = index | (np.signbit(x) & (index > 0)).astype(np.uint8) << 3
        if len(codes) % 2:
            codes = np.append(codes, np.uint8(0))
        packed = codes[0::2] | (codes[1::2] << 4)
        return s.tobytes() + packed.astype(np.uint8).tobytes()
    raise ValueError(f"precision must be bf16, fp8 or fp4, got {precision!r}")


def decode(data: bytes, shape: tuple[int, ...], precision: Precision = "bf16") -> np.ndarray:
    """Bytes from ``encode`` → float32 array of ``shape``; a wrong length is an error, not garbage."""
    n = int(np.prod(shape))
    header = 0 if precision == "bf16" else 4
    if len(data) != header + payload_bytes(shape, precision):
        raise ValueError(f"{precision} cache of shape {shape} needs {header + payload_bytes(shape, precision)} "
                         f"bytes, got {len(data)}")
    if precision == "bf16":
        raw = torch.from_numpy(np.frombuffer(data, np.int16).copy())
        return raw.view(torch.bfloat16).to(torch.float32).numpy().reshape(shape)
    s = np.frombuffer(data[:4], np.float32)[0]
    body = np.frombuffer(data[4:], np.uint8)
    if precision == "fp8":
        values = torch.from_numpy(body.copy()).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    else:
        codes = np.empty(2 * len(body), np.uint8)
        codes[0::2], codes[1::2] = body & 0x0F, body >> 4
        codes = codes[:n]
        values = FP4_VALUES[codes & 0x7] * np.where(codes & 0x8, -1.0, 1.0).astype(np.float32)
    return (values / s).astype(np.float32).reshape(shape)


def decode_rows(rows: np.ndarray, shape: tuple[int, ...], precision: Precision = "bf16") -> np.ndarray:
    """N encoded caches of one ``shape`` as an N×B uint8 array (each row the bytes of ``encode``) →
    N×``shape`` float32, the same values as ``decode`` row by row, in one vectorised pass."""
    n = int(np.prod(shape))
    header = 0 if precision == "bf16" else 4
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[1] != header + payload_bytes(shape, precision):
        raise ValueError(f"{precision} caches of shape {shape} need N×{header + payload_bytes(shape, precision)} "
                         f"uint8 rows, got {rows.dtype} {rows.shape}")
    count = rows.shape[0]
    rows = rows if rows.flags.writeable and rows.flags.c_contiguous else rows.copy()
    if precision == "bf16":
        raw = torch.from_numpy(rows.view(np.int16))
        return raw.view(torch.bfloat16).to(torch.float32).numpy().reshape(count, *shape)
    if precision not in ("fp8", "fp4"):
        raise ValueError(f"precision must be bf16, fp8 or fp4, got {precision!r}")
    scale = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # N×1
    body = rows[:, 4:]
    if precision == "fp8":
        values = torch.from_numpy(np.ascontiguousarray(body)).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    else:
        codes = np.empty((count, 2 * body.shape[1]), np.uint8)
        codes[:, 0::2], codes[:, 1::2] = body & 0x0F, body >> 4
        codes = codes[:, :n]
        values = FP4_VALUES[codes & 0x7] * np.where(codes & 0x8, -1.0, 1.0).astype(np.float32)
    return (values / scale).astype(np.float32).reshape(count, *shape)

"""Reranker cache codecs: exact sizes (2·T·M·d bytes in BF16), round trips, FP4 codes by hand."""

from __future__ import annotations

import numpy as np
import pytest

from models.reranker.cache_codec import decode, decode_rows, encode, payload_bytes


@pytest.mark.parametrize("shape", [(1, 4, 384), (8, 4, 384), (16, 1, 64)])
def test_bf16_payload_is_exactly_two_bytes_per_value(shape: tuple[int, int, int]) -> None:
    t, m, d = shape
    z = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    data = encode(z, "bf16")
    assert len(data) == 2 * t * m * d == payload_bytes(shape, "bf16")
    assert np.allclose(decode(data, shape, "bf16"), z, rtol=2 ** -7, atol=1e-6)


def test_fp8_and_fp4_sizes_and_errors() -> None:
    z = np.random.default_rng(1).normal(size=(4, 4, 32)).astype(np.float32)
    fp8, fp4 = encode(z, "fp8"), encode(z, "fp4")
    assert len(fp8) == 4 + 512 and len(fp4) == 4 + 256
    err8 = np.abs(decode(fp8, z.shape, "fp8") - z).max() / np.abs(z).max()
    err4 = np.abs(decode(fp4, z.shape, "fp4") - z).max() / np.abs(z).max()
    assert err8 < 0.07 and err4 < 0.17 and err8 < err4


def test_fp4_codes_by_hand() -> None:
    # scale = 6 / max|z| = 6 / 3 = 2 → z·2 = [6, -1, 0.5, 2.6]: codes 7, 8|2 = 10, 1, 5 (2.6 → 3.0, index 5)
    data = encode(np.array([3.0, -0.5, 0.25, 1.3], np.float32), "fp4")
    assert np.frombuffer(data[:4], np.float32)[0] == pytest.approx(2.0)
    assert list(data[4:]) == [7 | (10 << 4), 1 | (5 << 4)]
    assert decode(data, (4,), "fp4") == pytest.approx([3.0, -0.5, 0.25, 1.5])
    with pytest.raises(ValueError, match="needs 6 bytes"):
        decode(data[:5], (4,), "fp4")


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp4"])
def test_vectorised_decode_equals_row_by_row(precision: str) -> None:
    """``decode_rows`` (the query-time fetch) gives exactly ``decode``'s values for every row, odd
    FP4 lengths included; a wrong row width is an error."""
    for shape in ((8, 4, 6), (3, 5)):
        z = np.random.default_rng(2).normal(size=(5, *shape)).astype(np.float32)
        z[3] *= 40.0  # a different scale per row (fp8 / fp4)
        rows = np.stack([np.frombuffer(encode(c, precision), np.uint8) for c in z])
        got = decode_rows(rows, shape, precision)
        assert got.dtype == np.float32 and got.shape == (5, *shape)
        assert np.array_equal(got, np.stack([decode(r.tobytes(), shape, precision) for r in rows]))
        with pytest.raises(ValueError, match="uint8 rows"):
            decode_rows(rows[:, 1:], shape, precision)

"""Reason codes for rejected rows. Every input ends accepted or rejected with one of these."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why an input was rejected (stored as text in the ``reason`` column)."""

    # ingest: the input could not become an image
    MISSING_FILE = "missing_file"
    EMPTY_FILE = "empty_file"
    READ_ERROR = "read_error"
    FILE_TOO_LARGE = "file_too_large"
    NOT_AN_IMAGE = "not_an_image"
    CORRUPT_IMAGE = "corrupt_image"
    DECOMPRESSION_BOMB = "decompression_bomb"
    UNSUPPORTED_IMAGE = "unsupported_image"
    OUTSIDE_ROOT = "outside_root"
    UNKNOWN_DOMAIN = "unknown_domain"
    # denoise: the image is real but not usable
    DUPLICATE = "duplicate"
    TOO_SMALL = "too_small"
    BLURRY = "blurry"
    NO_TARGET = "no_target"
    MULTIPLE_TARGETS = "multiple_targets"
    MEASURE_ERROR = "measure_error"

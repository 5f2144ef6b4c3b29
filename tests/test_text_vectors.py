"""The on-disk store of fixed prompt lists' embeddings (models.backends.text_vectors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models.backends import text_vectors


class CountingEncoder:
    """A deterministic text encoder that counts the texts it was asked to encode."""

    model_id = "counting-encoder"
    dim = 4

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        self.encoded += len(texts)
        return np.array([[len(t), t.count("a"), t.count("e"), 1.0] for t in texts], np.float32)


@pytest.fixture(autouse=True)
def fresh_process_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text_vectors, "_memo", {})
    monkeypatch.delenv(text_vectors.CACHE_ENV, raising=False)


def test_a_later_process_reads_the_vectors_instead_of_encoding(tmp_path: Path) -> None:
    texts = ["a photo of a tabby", "a photo of a tram", "a photo of a jeep"]
    first = CountingEncoder()
    vectors = text_vectors.cached_text_vectors(first, texts, tmp_path)
    assert first.encoded == 3 and np.array_equal(vectors, first.encode(texts))
    assert len(list(tmp_path.glob("*.npy"))) == 1 and not list(tmp_path.glob(".tmp-*"))
    text_vectors._memo.clear()  # another process: nothing in memory, the file on disk
    later = CountingEncoder()
    again = text_vectors.cached_text_vectors(later, texts, tmp_path)
    assert later.encoded == 0 and np.array_equal(again, vectors)


def test_other_texts_or_another_encoder_are_another_key(tmp_path: Path) -> None:
    enc = CountingEncoder()
    text_vectors.cached_text_vectors(enc, ["a photo of a tabby"], tmp_path)
    text_vectors.cached_text_vectors(enc, ["an image of a tabby"], tmp_path)  # an edited prompt
    assert enc.encoded == 2
    other = CountingEncoder()
    other.model_id = "another-encoder"
    text_vectors._memo.clear()
    text_vectors.cached_text_vectors(other, ["a photo of a tabby"], tmp_path)
    assert other.encoded == 1 and len(list(tmp_path.glob("*.npy"))) == 3


def test_a_damaged_file_is_encoded_again_and_replaced(tmp_path: Path) -> None:
    texts = ["a photo of a tram", "a photo of a jeep"]
    enc = CountingEncoder()
    good = text_vectors.cached_text_vectors(enc, texts, tmp_path)
    [path] = tmp_path.glob("*.npy")
    np.save(path, np.zeros((5, 4), np.float32))  # wrong shape
    text_vectors._memo.clear()
    again = text_vectors.cached_text_vectors(enc, texts, tmp_path)
    assert enc.encoded == 4 and np.array_equal(again, good)
    path.write_bytes(b"not an npy file")
    text_vectors._memo.clear()
    assert np.array_equal(text_vectors.cached_text_vectors(enc, texts, tmp_path), good) and enc.encoded == 6
    assert np.array_equal(np.load(path), good)


def test_the_environment_names_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert text_vectors.cache_folder(tmp_path / "default") == tmp_path / "default"
    monkeypatch.setenv(text_vectors.CACHE_ENV, str(tmp_path / "shared"))
    assert text_vectors.cache_folder(tmp_path / "default") == tmp_path / "shared"

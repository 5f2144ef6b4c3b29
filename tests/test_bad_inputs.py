"""Every awkward input ends as an accepted row or a rejected row with a reason code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_input_corpus import make_corpus

from rde.image_decoding import DecodeError, decode_rgb, read_header
from rde.ingest import InputError, _list_paths_file, ingest_shard, list_inputs
from rde.profiles import IngestSpec, InputSpec

DOMAINS = ["pedestrian", "vehicle"]


@pytest.fixture(scope="module")
def person(person_crop: np.ndarray) -> np.ndarray:
    return person_crop


def test_ingest_reasons_for_each_corpus_file(tmp_path: Path, person: np.ndarray) -> None:
    expected = make_corpus(tmp_path / "corpus", person)
    refs, _ = list_inputs(InputSpec(kind="folder", path=str(tmp_path / "corpus")), tmp_path, DOMAINS)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS)
    assert images.num_rows + rejects.num_rows == len(expected) == len(refs)
    got = {Path(r["source"]).name: r["reason"] for r in rejects.to_pylist()}
    want = {name: reason for name, (stage, reason) in expected.items() if stage == "ingest"}
    assert got == want
    modes = {Path(r["source"]).name: r["source_mode"] for r in images.to_pylist()}
    assert modes["alpha.png"] == "RGBA" and modes["cmyk.jpg"] == "CMYK" and modes["gray.png"] == "L"
    assert modes["gray16.png"].startswith("I")


def test_unusual_formats_decode_to_8bit_rgb(tmp_path: Path, person: np.ndarray) -> None:
    make_corpus(tmp_path, person)
    for name in ("alpha.png", "cmyk.jpg", "gray16.png", "gray.png", "行人-ñ-😀 space.jpg"):
        arr = decode_rgb((tmp_path / name).read_bytes())
        assert arr.dtype == np.uint8 and arr.shape == (*person.shape[:2], 3), name
        assert 20 < arr.mean() < 235, name  # 16-bit scaled, not clipped to white or black


def test_decompression_bomb_is_caught_from_the_header() -> None:
    from bad_input_corpus import bomb_png

    with pytest.raises(DecodeError) as err:
        read_header(bomb_png(), max_pixels=50_000_000)
    assert err.value.reason == "decompression_bomb"
    with pytest.raises(DecodeError) as err:  # below PIL's own limit, above ours
        read_header(bomb_png(8000, 8000), max_pixels=1_000_000)
    assert err.value.reason == "decompression_bomb" and "64000000 pixels" in err.value.detail


def test_paths_file_missing_paths_directories_and_roots(tmp_path: Path, person: np.ndarray) -> None:
    make_corpus(tmp_path / "root", person)
    outside = tmp_path / "outside.jpg"
    outside.write_bytes((tmp_path / "root" / "ok_person.jpg").read_bytes())
    (tmp_path / "root" / "link.jpg").symlink_to(outside)
    table = pa.table({"path": ["root/ok_person.jpg", "root/missing.jpg", "root", "", str(outside),
                               "root/link.jpg"],
                      "domain": ["pedestrian", "pedestrian", None, "pedestrian", "pedestrian", "boats"]})
    pq.write_table(table, tmp_path / "paths.parquet")
    spec = InputSpec(kind="paths", path=str(tmp_path / "paths.parquet"))
    refs, _ = _list_paths_file(tmp_path / "paths.parquet", spec, tmp_path)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=[str(tmp_path / "root")])
    assert images.column("source").to_pylist() == [str(tmp_path / "root" / "ok_person.jpg")]
    assert rejects.column("reason").to_pylist() == ["missing_file", "read_error", "missing_file", "outside_root",
                                                    "unknown_domain"]
    assert len({r.input_id for r in refs}) == len(refs)


def test_unusable_inputs_as_a_whole_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist or is not a folder"):
        list_inputs(InputSpec(kind="folder", path=str(tmp_path / "nope")), tmp_path, DOMAINS)
    pq.write_table(pa.table({"file": ["a.jpg"]}), tmp_path / "p.parquet")
    with pytest.raises(InputError, match="has no 'path' column"):
        list_inputs(InputSpec(kind="paths", path=str(tmp_path / "p.parquet")), tmp_path, DOMAINS)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        list_inputs(InputSpec(kind="paths", path=str(tmp_path / "junk.parquet")), tmp_path, DOMAINS)


def test_file_too_large(tmp_path: Path, person: np.ndarray) -> None:
    make_corpus(tmp_path, person)
    refs, _ = list_inputs(InputSpec(kind="folder", path=str(tmp_path)), tmp_path, DOMAINS)
    _, rejects = ingest_shard(refs, IngestSpec(max_file_bytes=100), DOMAINS)
    assert "file_too_large" in rejects.column("reason").to_pylist()


def test_non_images_stay_not_an_image_after_ultralytics_patches_pillow() -> None:
    """ultralytics monkey-patches PIL.Image.open (HEIF auto-install); our decoding must not change."""
    pytest.importorskip("ultralytics")
    import ultralytics.utils.patches  # noqa: F401 - applies the patch
    from PIL import Image

    assert Image.open.__module__.startswith("ultralytics")
    with pytest.raises(DecodeError) as err:
        read_header(b"plain text, not an image", max_pixels=10**6)
    assert err.value.reason == "not_an_image"

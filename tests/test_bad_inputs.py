"""Every awkward input ends as an accepted row or a rejected row with a reason code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_input_corpus import make_corpus
from conftest import require_module

from rde.common.image_decoding import DecodeError, decode_rgb, read_header
from rde.common.ingest import ingest_shard
from rde.common.input_confinement import allowed_roots
from rde.common.input_listing import InputError, _list_paths_file, list_inputs
from rde.common.pool_config import IngestSpec, InputSpec

DOMAINS = ["pedestrian", "vehicle"]


@pytest.fixture(scope="module")
def person(person_crop: np.ndarray) -> np.ndarray:
    return person_crop


def test_ingest_reasons_for_each_corpus_file(tmp_path: Path, person: np.ndarray) -> None:
    expected = make_corpus(tmp_path / "corpus", person)
    refs, _ = list_inputs(InputSpec(kind="folder", path=str(tmp_path / "corpus")), tmp_path, DOMAINS)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=[str(tmp_path / "corpus")])
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


def _premultiplied_gray_tiff() -> bytes:
    """A gray TIFF with premultiplied ("associated", ExtraSamples = 1) alpha: Pillow opens and
    decodes it, as mode ``La``, which it has no conversion to RGB for. Pillow writes only
    unassociated alpha (ExtraSamples = 2), so that one tag value is patched."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("LA", (8, 6), (120, 200)).save(buf, "TIFF")
    unassociated = b"\x52\x01\x03\x00\x01\x00\x00\x00\x02\x00"  # tag 338, SHORT, 1 value: 2 (little-endian)
    data = buf.getvalue()
    assert data[:2] == b"II" and data.count(unassociated) == 1
    return data.replace(unassociated, unassociated[:-2] + b"\x01\x00")


def test_an_unconvertible_image_mode_and_local_read_errors_are_rejected_rows(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A file Pillow decodes but cannot convert is ``unsupported_image``; a local file whose open
    fails (EACCES: as root no mode bits deny a read, so the refusal is injected) or whose read fails
    with a real I/O error (``/proc/self/mem`` at offset 0 is unmapped: EIO) is ``read_error``."""
    import errno
    import os

    from PIL import Image

    from rde.common.input_listing import InputRef

    (tmp_path / "premultiplied.tif").write_bytes(_premultiplied_gray_tiff())
    assert Image.open(tmp_path / "premultiplied.tif").mode == "La"
    denied = tmp_path / "denied.jpg"
    denied.write_bytes(b"\xff\xd8 a file only the injected EACCES keeps from being read")
    real_open = os.open

    def refusing(path, *args, **kwargs):
        if str(path) == os.path.realpath(denied):  # ingest opens the real path
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    refs = [InputRef(f"i{k}", str(source), "pedestrian")
            for k, source in enumerate((tmp_path / "premultiplied.tif", denied, "/proc/self/mem"))]
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=None)
    assert images.num_rows == 0
    got = {r["input_id"]: (r["reason"], r["detail"]) for r in rejects.to_pylist()}
    assert got["i0"][0] == "unsupported_image" and "cannot convert mode La to RGB" in got["i0"][1], got
    assert got["i1"] == ("read_error", f"{denied}: Permission denied"), got
    assert got["i2"] == ("read_error", "/proc/self/mem: Input/output error"), got


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
    spec = InputSpec(kind="paths", path=str(tmp_path / "paths.parquet"), default_domain="pedestrian")
    refs, _ = _list_paths_file(str(tmp_path / "paths.parquet"), spec)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=[str(tmp_path / "root")])
    assert images.column("source").to_pylist() == [str(tmp_path / "root" / "ok_person.jpg")]
    assert rejects.column("reason").to_pylist() == ["missing_file", "not_a_regular_file", "missing_file",
                                                    "outside_root", "unknown_domain"]
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
    """Exactly the files over ``max_file_bytes`` are rejected as too large; the limit is the size
    of one corpus file, which is read (the limit is inclusive) and becomes an image."""
    make_corpus(tmp_path, person)
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    limit = sizes["one_pixel.png"]
    over = {name for name, size in sizes.items() if size > limit}
    assert over and len(over) < len(sizes) - 1  # files on both sides of the limit, not only the one on it
    refs, _ = list_inputs(InputSpec(kind="folder", path=str(tmp_path)), tmp_path, DOMAINS)
    images, rejects = ingest_shard(refs, IngestSpec(max_file_bytes=limit), DOMAINS, roots=[str(tmp_path)])
    assert images.num_rows + rejects.num_rows == len(refs) == len(sizes)
    too_large = {Path(r["source"]).name for r in rejects.to_pylist() if r["reason"] == "file_too_large"}
    assert too_large == over
    assert [Path(r["source"]).name for r in images.to_pylist()] == ["one_pixel.png"]


def test_non_images_stay_not_an_image_after_ultralytics_patches_pillow() -> None:
    """ultralytics monkey-patches PIL.Image.open (HEIF auto-install); our decoding must not change."""
    require_module("ultralytics")
    import ultralytics.utils.patches  # noqa: F401 - applies the patch
    from PIL import Image

    assert Image.open.__module__.startswith("ultralytics")
    with pytest.raises(DecodeError) as err:
        read_header(b"plain text, not an image", max_pixels=10**6)
    assert err.value.reason == "not_an_image"


# -- confinement (secure by default) and files that are not regular ------------------------------------

def _reasons_by_name(folder: Path, spec: InputSpec, project: Path) -> dict[str, str | None]:
    """Every listed input → its reject reason, or None when it became an image (through the ingest
    stage's own root rule)."""
    refs, _ = list_inputs(spec, project, DOMAINS)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(spec, project))
    assert images.num_rows + rejects.num_rows == len(refs)
    out: dict[str, str | None] = {Path(r["source"]).name: None for r in images.to_pylist()}
    out.update({Path(r["source"]).name: r["reason"] for r in rejects.to_pylist()})
    return out


def test_folder_input_never_reads_outside_its_folder(tmp_path: Path, person: np.ndarray) -> None:
    make_corpus(tmp_path / "elsewhere", person)
    secret = tmp_path / "elsewhere" / "ok_person.jpg"
    inbox = tmp_path / "inbox"
    (inbox / "sub").mkdir(parents=True)
    (inbox / "own.jpg").write_bytes(secret.read_bytes())
    (inbox / "link_out.jpg").symlink_to(secret)  # a link to an image outside the folder
    (inbox / "dir_out").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # a link to a folder outside
    (inbox / "dotdot.jpg").symlink_to("../elsewhere/ok_person.jpg")  # '..' segments
    (inbox / "sub" / "hop.jpg").symlink_to(inbox / "own.jpg")  # a chain that ends inside: accepted
    (inbox / "chain.jpg").symlink_to(inbox / "sub" / "hop.jpg")
    (inbox / "dir_in").symlink_to(inbox / "sub", target_is_directory=True)  # a folder, not a file
    (inbox / "dangling.jpg").symlink_to(inbox / "gone.jpg")
    (inbox / "dangling_out.jpg").symlink_to(tmp_path / "gone.jpg")  # says nothing about the outside
    got = _reasons_by_name(inbox, InputSpec(kind="folder", path=str(inbox)), tmp_path)
    assert got == {"own.jpg": None, "chain.jpg": None, "hop.jpg": None, "link_out.jpg": "outside_root",
                   "dir_out": "outside_root", "dotdot.jpg": "outside_root", "dir_in": "not_a_regular_file",
                   "dangling.jpg": "missing_file", "dangling_out.jpg": "outside_root"}
    refs, _ = list_inputs(InputSpec(kind="folder", path=str(inbox)), tmp_path, DOMAINS)
    _, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(InputSpec(kind="folder",
                                                                                        path=str(inbox)), tmp_path))
    detail = next(r["detail"] for r in rejects.to_pylist() if r["source"].endswith("link_out.jpg"))
    assert str(secret.resolve()) in detail  # the resolved path is shown
    # the explicit switch reads the link's target
    unconfined = _reasons_by_name(inbox, InputSpec(kind="folder", path=str(inbox), confine=False), tmp_path)
    assert unconfined["link_out.jpg"] is None and unconfined["dotdot.jpg"] is None


def test_path_list_is_confined_to_its_roots_or_its_own_folder(tmp_path: Path, person: np.ndarray) -> None:
    make_corpus(tmp_path / "lists" / "imgs", person)
    make_corpus(tmp_path / "other", person)
    absolute_outside = str(tmp_path / "other" / "ok_person.jpg")
    table = pa.table({"path": ["imgs/ok_person.jpg", absolute_outside, "imgs/../../other/gray.png",
                               str(tmp_path / "lists" / "imgs" / "gray.png")]})
    pq.write_table(table, tmp_path / "lists" / "paths.parquet")
    spec = InputSpec(kind="paths", path=str(tmp_path / "lists" / "paths.parquet"))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert [Path(s).name for s in images.column("source").to_pylist()] == ["ok_person.jpg", "gray.png"]
    assert rejects.column("reason").to_pylist() == ["outside_root", "outside_root"]
    # roots named in the profile replace the list's folder
    spec_roots = spec.model_copy(update={"roots": [str(tmp_path / "other")]})
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(spec_roots, tmp_path))
    assert [Path(s).name for s in images.column("source").to_pylist()] == ["ok_person.jpg", "gray.png"]
    assert images.column("source").to_pylist()[0] == absolute_outside
    assert rejects.column("reason").to_pylist() == ["outside_root", "outside_root"]


def test_fifo_is_a_rejected_row_and_never_opened(tmp_path: Path, person: np.ndarray) -> None:
    """A FIFO would block a reader forever: found by stat, rejected, and the ingest ends promptly."""
    import os
    import socket
    import threading

    folder = tmp_path / "in"
    make_corpus(folder, person)
    os.mkfifo(folder / "pipe.jpg")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock"))
    result: dict[str, dict[str, str | None]] = {}
    worker = threading.Thread(target=lambda: result.update(
        got=_reasons_by_name(folder, InputSpec(kind="folder", path=str(folder)), tmp_path)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    sock.close()
    assert not worker.is_alive(), "ingest blocked on the FIFO"
    assert result["got"]["pipe.jpg"] == "not_a_regular_file" and result["got"]["sock"] == "not_a_regular_file"
    assert len(result["got"]) == len(list(folder.iterdir()))  # every entry of the folder is a row


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied_and_recorded(tmp_path: Path, person: np.ndarray, orientation: int) -> None:
    """A photo stored sideways with an orientation tag decodes upright, with the displayed size."""
    from PIL import Image

    upright = Image.fromarray(person)  # taller than wide
    stored = {3: upright.transpose(Image.Transpose.ROTATE_180), 6: upright.transpose(Image.Transpose.ROTATE_90),
              8: upright.transpose(Image.Transpose.ROTATE_270)}[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"phone-{orientation}.png"
    stored.save(path, "PNG", exif=exif.tobytes())
    data = path.read_bytes()
    header = read_header(data, 10**8)
    assert (header.width, header.height, header.orientation) == (upright.width, upright.height, orientation)
    arr = decode_rgb(data)
    assert arr.shape == (upright.height, upright.width, 3)
    assert np.abs(arr.astype(int) - np.asarray(upright).astype(int)).mean() < 1.0
    spec = InputSpec(kind="folder", path=str(tmp_path))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    images, _ = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    row = images.to_pylist()[0]
    assert (row["width"], row["height"], row["exif_orientation"]) == (upright.width, upright.height, orientation)


def test_run_parameters_cannot_widen_confinement() -> None:
    """Deployment parameters and --set are untrusted: only a profile file may turn confinement off."""
    from rde.profile import ProfileError, load_profile

    for key, value in (("confine", False), ("roots", ["/"])):
        with pytest.raises(ProfileError, match=f"input.{key} can only be set in a profile file"):
            load_profile("demo", {"input": {key: value}})
    assert load_profile("demo", {"input": {"kind": "folder", "path": "/tmp"}}).input.confine is True


def test_path_list_rows_that_name_no_local_file_are_rejected_and_the_other_rows_go_on(
        tmp_path: Path, person: np.ndarray) -> None:
    """A NUL byte, a file:// URL or a URL no store reads in a path list is one rejected row with its
    reason (the URL's scheme named), rejected as listed (never joined to the list's folder); a URL
    outside the list's roots is outside_root, never requested; every good row before and after it
    becomes an image."""
    from bad_input_corpus import BAD_PATH_ROWS

    expected = make_corpus(tmp_path / "root", person)
    good = sorted(name for name, (stage, _) in expected.items() if stage == "denoise")  # pass ingest
    (tmp_path / "root" / "odd:name.jpg").write_bytes((tmp_path / "root" / "ok_person.jpg").read_bytes())
    good_rows = [f"root/{name}" for name in [*good, "odd:name.jpg"]]
    paths = [good_rows[0], *BAD_PATH_ROWS, *good_rows[1:]]
    pq.write_table(pa.table({"path": paths}), tmp_path / "paths.parquet")
    spec = InputSpec(kind="paths", path=str(tmp_path / "paths.parquet"))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert images.num_rows + rejects.num_rows == len(refs) == len(paths)
    assert sorted(Path(s).name for s in images.column("source").to_pylist()) == sorted([*good, "odd:name.jpg"])
    by_source = {r["source"]: r for r in rejects.to_pylist()}
    shown = {raw: raw.replace("\x00", "\\x00") for raw in BAD_PATH_ROWS}
    shown["s3:/bucket/ok_person.jpg"] = str(tmp_path / "s3:/bucket/ok_person.jpg")  # joined: a local path
    assert {source: r["reason"] for source, r in by_source.items()} == {
        shown[raw]: reason for raw, reason in BAD_PATH_ROWS.items()}
    assert not any("\x00" in r["source"] for r in rejects.to_pylist())  # the stored source is plain text
    for raw, reason in BAD_PATH_ROWS.items():
        detail = by_source[shown[raw]]["detail"]
        if reason == "unsupported_url":
            assert f"is a {raw.split('://')[0]}:// URL" in detail, detail
        elif reason == "outside_root":
            assert "outside the allowed roots" in detail, detail
        elif reason == "invalid_path":
            assert "NUL byte" in detail and "\\x00" in detail, detail

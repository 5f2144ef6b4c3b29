"""Reading captions with their images: the WebDataset tars against the Parquet shards, same images.

The images are the pool's (``--pool``, default the demo pool); each gets three tier texts of the
demo's lengths (seeded filler words: the texts' content does not change a read). Both layouts are
written as ``build-largefine`` writes them, in shards of ``--shard`` images:

- **Parquet**: the caption shards (``TIER_CAPTIONS``: one row per image and tier) and the images in
  the accepted-images layout (``image_id``, ``image_bytes``; row groups of ``IMAGE_ROW_GROUP``). A
  reader gets a caption shard's texts, then its images from the image shards by id (the join a
  training loader of the Parquet layout does).
- **WebDataset**: the tars of ``rde.largefine.webdataset_export.write_tar`` (the export stage's own
  code), read with ``webdataset.WebDataset(...).decode("pil")``.

Each read decodes every image to pixels (``numpy.asarray``) and keeps its texts. The two readers
alternate, ``--repeats`` times each, in one process; the table gives the median images per second
and the ratio.

    .venv/bin/python benchmarks/webdataset_read.py [--pool data/demo_pool] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_layouts(pool: str, work: Path, shard: int) -> int:
    """Both layouts of the pool's images under ``work``; returns the image count."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rde.largefine.webdataset_export import tar_name, write_tar
    from storage import Artifact
    from storage.artifact import IMAGE_ROW_GROUP
    from storage.hashing import sha256_bytes
    from storage.schemas import TIER_CAPTIONS

    rng = np.random.default_rng(0)
    filler = "a person in dark jacket walks with bag near the street carrying blue jeans white shoes backpack"
    words = np.array(filler.split())
    images: list[dict] = []
    seen: set[str] = set()
    for _, table in Artifact(pool).iter_shards(["pool_id", "domain", "image_bytes"]):
        for rec in table.to_pylist():
            data = rec["image_bytes"]
            if sha256_bytes(data) in seen:  # an exact copy: denoise keeps one, so the export has one
                continue
            seen.add(sha256_bytes(data))
            images.append({"image_id": sha256_bytes(data), "input_id": rec["pool_id"], "source": rec["pool_id"],
                           "domain": rec["domain"], "identity": None,
                           "image_format": "PNG" if data[:4] == b"\x89PNG" else "JPEG", "image_bytes": data})
    (work / "captions").mkdir()
    (work / "images").mkdir()
    (work / "tars").mkdir()
    for index, start in enumerate(range(0, len(images), shard)):
        part = images[start:start + shard]
        captions = [{"image_id": im["image_id"], "source": im["source"], "domain": im["domain"], "tier": tier,
                     "text": " ".join(rng.choice(words, size=length)), "raw_text": None, "cleaning": [],
                     "q_txt": 0.5, "words": length, "generator": "g", "generator_index": 0, "prompt": "p",
                     "template_id": None, "gallery": None, "hard_negative_id": None}
                    for im in part for tier, length in (("base", 25), ("inter", 30), ("adv", 40))]
        pq.write_table(pa.Table.from_pylist(captions, schema=TIER_CAPTIONS),
                       work / "captions" / f"part-{index:05d}.parquet")
        pq.write_table(pa.table({"image_id": [im["image_id"] for im in part],
                                 "image_bytes": [im["image_bytes"] for im in part]}),
                       work / "images" / f"part-{index:05d}.parquet", row_group_size=IMAGE_ROW_GROUP)
        data, _ = write_tar(part, captions)
        (work / "tars" / tar_name(index)).write_bytes(data)
    return len(images)


def read_parquet(work: Path) -> int:
    """Every caption shard's texts, then its images by id from the image shards, decoded."""
    import io

    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from PIL import Image

    images = ds.dataset(str(work / "images"), format="parquet")
    count = 0
    for path in sorted((work / "captions").glob("*.parquet")):
        rows = pq.read_table(path, columns=["image_id", "tier", "text"]).to_pylist()
        texts: dict[str, dict[str, str]] = {}
        for row in rows:
            texts.setdefault(row["image_id"], {})[row["tier"]] = row["text"]
        found = images.to_table(filter=pc.field("image_id").isin(list(texts)))
        for image_id, data in zip(found.column("image_id").to_pylist(), found.column("image_bytes").to_pylist(),
                                  strict=True):
            pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            count += int(pixels.size > 0 and bool(texts[image_id]))
    return count


def read_tars(work: Path) -> int:
    import numpy as np
    import webdataset as wds

    count = 0
    tars = sorted(str(p) for p in (work / "tars").glob("*.tar"))
    for sample in wds.WebDataset(tars, shardshuffle=False).decode("pil"):
        image = sample.get("jpg") or sample.get("png")
        pixels = np.asarray(image.convert("RGB"))
        count += int(pixels.size > 0 and bool(sample["json"]["texts"]))
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default=str(ROOT / "data" / "demo_pool"))
    parser.add_argument("--shard", type=int, default=64, help="images per shard (largefine.shard_size)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        n = write_layouts(args.pool, work, args.shard)
        sizes = {name: sum(p.stat().st_size for p in (work / name).glob("*"))
                 for name in ("captions", "images", "tars")}
        rates: dict[str, list[float]] = {"parquet": [], "webdataset": []}
        for _ in range(args.repeats):
            for name, reader in (("parquet", read_parquet), ("webdataset", read_tars)):
                start = time.perf_counter()
                got = reader(work)
                seconds = time.perf_counter() - start
                if got != n:
                    raise SystemExit(f"{name} read {got} of {n} images with texts")
                rates[name].append(n / seconds)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{n} images in shards of {args.shard}; on disk: Parquet {(sizes['captions'] + sizes['images']) / 2**20:.1f} "
          f"MiB (captions + images), tars {sizes['tars'] / 2**20:.1f} MiB\n")
    print("| layout | median images/s | runs (images/s) |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {med[name]:.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    print(f"\nwebdataset / parquet = {med['webdataset'] / med['parquet']:.2f}")


if __name__ == "__main__":
    main()

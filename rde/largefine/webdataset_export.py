"""The LargeFine captions as WebDataset tar shards: one sample per captioned image.

Each sample is ``<image_id>.<ext>`` (the image's own bytes, its extension from its format) and
``<image_id>.json``: the image's texts per tier, each tier's ``q_txt`` (GTR+ Eq. 8), the hard
negative's id, and the lineage (input id, source, domain, identity, and per tier the generator,
prompt and template). The tar is written with the ``webdataset`` library's ``TarWriter``, in
memory (one captioning shard: at most ``largefine.shard_size`` images) with a fixed modification
time, so the same captions give the same bytes, and then stored in one atomic write, so a reader
never sees half a tar.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from typing import Any

# image format (as ingest records it) → the member extension webdataset's decoders know
EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tiff", "GIF": "gif",
              "PPM": "ppm", "MPO": "jpg"}


def tar_name(index: int) -> str:
    """The tar of captioning shard ``index`` (beside the index's ``part-*.parquet`` files)."""
    return f"shard-{index:05d}.tar"


def sample_json(image: dict[str, Any], captions: list[dict[str, Any]]) -> dict[str, Any]:
    """The json member of one image: its texts and their lineage (``captions``: its TIER_CAPTIONS rows)."""
    texts = {c["tier"]: c["text"] for c in captions}
    return {"image_id": image["image_id"], "texts": texts,
            "q_txt": {c["tier"]: c["q_txt"] for c in captions},
            "hard_negative_id": next((c["hard_negative_id"] for c in captions if c["hard_negative_id"]), None),
            "lineage": {"input_id": image["input_id"], "source": image["source"], "domain": image["domain"],
                        "identity": image["identity"],
                        "tiers": {c["tier"]: {"generator": c["generator"], "prompt": c["prompt"],
                                              "template_id": c["template_id"], "gallery": c["gallery"]}
                                  for c in captions}}}


def write_tar(images: list[dict[str, Any]], captions: list[dict[str, Any]]) -> tuple[bytes, list[dict[str, Any]]]:
    """The tar bytes of the images that have at least one text, in the images' order, and one index
    row per sample (image_id, key, members, tiers)."""
    import webdataset as wds  # here: the package imports torch, which a run without this export never needs

    by_image: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in captions:
        by_image[row["image_id"]].append(row)
    buffer = io.BytesIO()
    index: list[dict[str, Any]] = []
    with wds.TarWriter(buffer, mtime=0.0) as sink:  # a fixed mtime: the same captions, the same bytes
        for image in images:
            rows = by_image.get(image["image_id"])
            if not rows:
                continue
            ext = EXTENSIONS.get(str(image["image_format"]).upper(), "img")
            meta = sample_json(image, rows)
            sink.write({"__key__": image["image_id"], ext: image["image_bytes"],
                        "json": json.dumps(meta, sort_keys=True).encode()})
            index.append({"image_id": image["image_id"], "key": image["image_id"],
                          "members": [f"{image['image_id']}.{ext}", f"{image['image_id']}.json"],
                          "tiers": sorted(meta["texts"])})
    return buffer.getvalue(), index

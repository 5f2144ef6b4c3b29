"""A synthetic scale pool: N distinct images derived from a source pool (the demo pool) by seeded
transformations, to exercise the engine at 10k or 100k images with no internet.

It is for load, not for quality: the images are the demo crops again, moved, rescaled, flipped,
recoloured, noised and blurred, so a dataset built from them is no better than the demo's. What it
preserves is what the engine's accounting needs: each image keeps its source's domain and
identity, and its source's variant (a ``tiny``, ``blurred``, ``background`` or ``group`` source
stays one, so it still fails its denoise rule), and a seeded share are exact ``duplicate`` copies
of an earlier synthetic image. Image ``i`` depends only on (seed, i) and the source pool, never on
the shard layout or on which images came before, so a rerun writes the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import cv2
import numpy as np
import pyarrow as pa

from rde.common.image_decoding import decode_rgb, encode_jpeg
from storage import Artifact, ArtifactWriter, content_key
from storage.schemas import POOL

SYNTH_VERSION = "1"  # bump when a transformation changes: the pool's key (and bytes) change


@dataclass(frozen=True)
class SynthParams:
    """How the scale pool is drawn. Ranges are (low, high) of a uniform draw per image."""

    n: int
    seed: int = 0
    shard_size: int = 1000
    duplicate_share: float = 0.01  # exact copies of an earlier synthetic image (denoise: duplicate)
    keep_side: tuple[float, float] = (0.88, 1.0)  # share of each side kept by the random crop
    scale: tuple[float, float] = (1.0, 1.25)  # rescale of a usable crop (never below its source)
    tiny_scale: tuple[float, float] = (0.6, 0.95)  # rescale of a ``tiny`` source: it stays too small
    gain: tuple[float, float] = (0.9, 1.1)  # per-channel colour gain
    noise_sigma: tuple[float, float] = (0.0, 3.0)  # Gaussian pixel noise (0-255 scale)
    blur_sigma: tuple[float, float] = (0.0, 0.5)  # mild blur of a usable crop
    blurred_sigma: tuple[float, float] = (2.0, 3.5)  # blur of a ``blurred`` source: it stays blurry
    jpeg_quality: int = 90


@dataclass(frozen=True)
class Source:
    pool_id: str
    domain: str
    identity: str | None
    variant: str
    rgb: np.ndarray


def load_sources(pool_url: str) -> list[Source]:
    """The source pool's rows with decoded pixels (the demo pool: 824 small crops)."""
    rows = Artifact(pool_url).rows(["pool_id", "domain", "identity", "variant", "image_bytes"])
    return [Source(r["pool_id"], r["domain"], r["identity"], r["variant"], decode_rgb(r["image_bytes"]))
            for r in rows]


def transform(rgb: np.ndarray, variant: str, rng: np.random.Generator, p: SynthParams) -> tuple[np.ndarray, dict]:
    """One seeded variation of ``rgb``: crop, rescale, flip, colour gain, noise, blur (in that order).
    A ``tiny`` source is only shrunk and a ``blurred`` one blurred harder, so each keeps failing."""
    h, w = rgb.shape[:2]
    ch = max(1, round(h * rng.uniform(*p.keep_side)))
    cw = max(1, round(w * rng.uniform(*p.keep_side)))
    y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    out = rgb[y0:y0 + ch, x0:x0 + cw]
    scale = float(rng.uniform(*(p.tiny_scale if variant == "tiny" else p.scale)))
    size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
    out = cv2.resize(out, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
    flip = bool(rng.random() < 0.5)
    if flip:
        out = out[:, ::-1]
    gain = rng.uniform(*p.gain, size=3)
    noise = float(rng.uniform(*p.noise_sigma))
    pixels = out.astype(np.float32) * gain + rng.normal(0.0, noise, out.shape).astype(np.float32)
    out = np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
    blur = float(rng.uniform(*(p.blurred_sigma if variant == "blurred" else p.blur_sigma)))
    if blur > 0.05:
        out = cv2.GaussianBlur(out, (0, 0), blur)
    ops = {"crop": [x0, y0, cw, ch], "scale": round(scale, 4), "flip": flip,
           "gain": [round(float(g), 4) for g in gain], "noise": round(noise, 3), "blur": round(blur, 3)}
    return np.ascontiguousarray(out), ops


def synth_row(sources: list[Source], index: int, p: SynthParams) -> dict[str, Any]:
    """Synthetic image ``index`` (a POOL row): a function of (seed, index) and the sources only."""
    rng = np.random.default_rng([p.seed, index])
    if index > 0 and rng.random() < p.duplicate_share:
        earlier = synth_row(sources, int(rng.integers(index)), p)
        meta = {"duplicate_of": earlier["pool_id"], **json.loads(earlier["source_meta"])}
        return {**earlier, "pool_id": f"synth:{index:08d}:duplicate", "variant": "duplicate",
                "source_meta": json.dumps(meta, sort_keys=True)}
    src = sources[int(rng.integers(len(sources)))]
    rgb, ops = transform(src.rgb, src.variant, rng, p)
    return {"pool_id": f"synth:{index:08d}:{src.variant}", "domain": src.domain, "identity": src.identity,
            "variant": src.variant, "source_meta": json.dumps({"source": src.pool_id, "ops": ops}, sort_keys=True),
            "image_bytes": encode_jpeg(rgb, p.jpeg_quality)}


def write_synth_pool(source_url: str, out: str, p: SynthParams,
                     on_shard: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write the scale pool as a pool artifact at ``out`` (resumable: shards a previous run of the
    same parameters wrote are kept). Returns its stats: rows by domain/variant, shards reused.
    ``on_shard(done, total)`` reports progress."""
    if p.n < 1 or p.shard_size < 1:
        raise ValueError(f"--n and --shard-size must be at least 1, got {p.n} and {p.shard_size}")
    source = Artifact(source_url)
    if not source.is_complete():
        raise ValueError(f"{source_url} is not a complete pool artifact (run `rde pool build` first)")
    key = content_key(kind="synth-pool", version=SYNTH_VERSION, source=source.manifest().fingerprint,
                      params=asdict(p))
    writer = ArtifactWriter(out, "pool", POOL, key)
    writer.begin()
    sources = load_sources(source_url)
    total = -(-p.n // p.shard_size)
    shards, counts, reused = [], {}, 0
    for index in range(total):
        found = writer.existing_shard(index)
        if found is None:
            start = index * p.shard_size
            rows = [synth_row(sources, i, p) for i in range(start, min(p.n, start + p.shard_size))]
            table = pa.Table.from_pylist(rows, schema=POOL)
            found = writer.write_shard(index, table)
        else:  # a shard a previous run wrote: its labels are read back, its images are not
            reused += 1
            table = writer.read_shard(index, ["domain", "variant"])
        shards.append(found)
        for domain, variant in zip(table.column("domain").to_pylist(), table.column("variant").to_pylist(),
                                   strict=True):
            counts[f"{domain}/{variant}"] = counts.get(f"{domain}/{variant}", 0) + 1
        if on_shard:
            on_shard(index + 1, total)
    stats = {"counts": dict(sorted(counts.items())), "rows": p.n, "shards_reused": reused,
             "purpose": "load testing only: transformed demo crops, not new data"}
    writer.finalize(shards, code_version=f"synth-pool-{SYNTH_VERSION}", config={"params": asdict(p)},
                    upstream=[source], stats=stats)
    return stats


def write_synth_training_pairs(pool_url: str, out: str, captions_per_image: int = 3, teacher_dim: int = 16,
                               seed: int = 0, held_out_share: float = 0.0) -> int:
    """A pool artifact's images as streamed training pairs (``TRAINING_PAIRS``, one shard per pool
    shard), for load tests of the streamed trainer with no captioner and no teacher: each image gets
    ``captions_per_image`` fixed captions and a seeded random teacher vector per image and per
    caption; a seeded ``held_out_share`` of the images is held out. Returns the training pairs."""
    from rde.common.seeds import draw_seed
    from storage.schemas import TRAINING_PAIRS

    pool = Artifact(pool_url)
    writer = ArtifactWriter(out, "training_pairs", TRAINING_PAIRS,
                            content_key(kind="synth-pairs", source=pool.manifest().fingerprint,
                                        params=[captions_per_image, teacher_dim, seed, held_out_share]))
    writer.begin()
    numbered, shards = {"train": 0, "heldout": 0}, []
    for index, table in pool.iter_shards(["pool_id", "domain", "identity", "image_bytes"]):
        rows = []
        for r in table.to_pylist():
            image_seed = draw_seed(seed, r["pool_id"])
            rng = np.random.default_rng(image_seed)
            split = "heldout" if rng.random() < held_out_share else "train"
            teacher_image = rng.standard_normal(teacher_dim).astype(np.float32)
            for k in range(captions_per_image):
                rows.append({"split": split, "pair": numbered[split], "image_id": r["pool_id"],
                             "image_key": image_seed, "identity": r["identity"],
                             "text": f"a {r['domain']} seen by a surveillance camera, caption {k}",
                             "q_txt": float(rng.uniform(0.5, 1.0)), "image": r["image_bytes"],
                             "teacher_image": teacher_image.tolist(),
                             "teacher_text": rng.standard_normal(teacher_dim).astype(np.float32).tolist()})
                numbered[split] += 1
        shards.append(writer.write_shard(index, pa.Table.from_pylist(rows, schema=TRAINING_PAIRS)))
    writer.finalize(shards, code_version=SYNTH_VERSION, stats=dict(numbered))
    return numbered["train"]

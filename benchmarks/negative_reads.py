"""What a caption task pays to fetch a few images of an accepted shard (its hard negatives lie
spread over the pool): the whole shard read and filtered (before) against ``Artifact.read_matching``
(the id column, then only the row groups holding the wanted ids), side by side in one run.

    .venv/bin/python benchmarks/negative_reads.py [--rows 4096] [--kb 50] [--wanted 1 4 16] [--repeats 5]

The shard is written by ``ArtifactWriter`` as the product writes image tables (row groups of
``IMAGE_ROW_GROUP`` rows); the image bytes are random, so zstd cannot shrink them (as with JPEG).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from storage import Artifact, ArtifactWriter
from storage.artifact import IMAGE_ROW_GROUP

SCHEMA = pa.schema([pa.field("image_id", pa.string()), pa.field("image_bytes", pa.binary())])


def write_shard(folder: Path, rows: int, kb: int) -> Artifact:
    rng = np.random.default_rng(0)
    table = pa.table({"image_id": [f"img-{i:07d}" for i in range(rows)],
                      "image_bytes": [rng.bytes(kb * 1024) for _ in range(rows)]}, schema=SCHEMA)
    writer = ArtifactWriter(str(folder), "images", SCHEMA, "bench")
    writer.begin()
    writer.finalize([writer.write_shard(0, table)], code_version="bench", config={}, models={}, prompt_versions={},
                    upstream=(), stats={})
    return Artifact(str(folder))


def whole_shard(art: Artifact, wanted: set[str]) -> int:
    table = art.read_shard(0, ["image_id", "image_bytes"])
    return sum(1 for i in table.column("image_id").to_pylist() if i in wanted)


def matching(art: Artifact, wanted: set[str]) -> int:
    return art.read_matching(0, "image_id", wanted, ["image_id", "image_bytes"]).num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--kb", type=int, default=50)
    parser.add_argument("--wanted", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        art = write_shard(Path(tmp) / "accepted", args.rows, args.kb)
        print(f"one shard of {args.rows} images of {args.kb} KB, row groups of {IMAGE_ROW_GROUP} rows "
              f"(OS page cache warm after the first read)\n")
        print("| wanted images | whole shard ms | read_matching ms | ratio |")
        print("|---|---|---|---|")
        rng = np.random.default_rng(1)
        for n in args.wanted:
            wanted = {f"img-{i:07d}" for i in rng.choice(args.rows, size=n, replace=False)}
            times: dict[str, list[float]] = {"whole": [], "matching": []}
            for _ in range(args.repeats):  # alternated, so both see the same machine
                for name, fn in (("whole", whole_shard), ("matching", matching)):
                    start = time.perf_counter()
                    assert fn(art, wanted) == n
                    times[name].append(1000 * (time.perf_counter() - start))
            whole, match = statistics.median(times["whole"]), statistics.median(times["matching"])
            print(f"| {n} | {whole:.1f} | {match:.1f} | {match / whole:.3f} |")


if __name__ == "__main__":
    main()

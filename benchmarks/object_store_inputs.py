"""The same images from a local folder and from S3: ``build-secmm --until candidates`` side by side.

N images of a synthetic pool (``rde pool synth``) are written out as files, one folder per domain,
and the same files are uploaded under ``s3://rde-bench/images/`` on moto's S3 server (loopback).
Then one CLI process per input, back to back in this invocation: ``--input <folder>`` and
``--input s3://rde-bench/images/`` (the output is local in both). For each: wall seconds, the
ingest stage's seconds, the peak RSS of the CLI and its children (psutil, every 0.2 s), and for the
S3 run the requests the server logged while it ran, per image and by kind (listing pages, object
GETs, other). The generator work (caption pool, DAP) is the same small fixed budget as in
``benchmarks/scale.py``. Both runs must keep the same images: the same accepted count and the same
image ids.

    .venv/bin/python benchmarks/object_store_inputs.py [--n 10000] [--workdir /tmp/rde-s3-inputs]

moto is an in-process Python server on this machine: its latency is a loopback's and its
throughput one Python thread's. Reads from a real bucket pay a network round trip per GET (they are
issued concurrently per ingest shard); a real endpoint's numbers are not these.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from models.backends.disk_memo import keep_nothing_on_disk

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the moto server helper
sys.path.insert(0, str(ROOT / "benchmarks"))

BUCKET = "rde-bench"
REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP')


def export_folder(pool: Path, folder: Path) -> int:
    """The pool's images as files ``<domain>/<pool_id>.<ext>`` (written once; returns the count)."""
    from storage import Artifact

    done = folder.with_name(folder.name + ".complete")  # beside the folder: not an input
    if done.exists():
        return int(done.read_text())
    count = 0
    for _, table in Artifact(str(pool)).iter_shards(["pool_id", "domain", "image_bytes"]):
        for rec in table.to_pylist():
            ext = "png" if rec["image_bytes"][:4] == b"\x89PNG" else "jpg"
            path = folder / rec["domain"] / f"{rec['pool_id'].replace(':', '_')}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rec["image_bytes"])
            count += 1
    done.write_text(str(count))
    return count


def classify(lines: list[str]) -> dict[str, int]:
    """Requests the server logged, by kind: listing pages, object GETs, other."""
    kinds = {"list": 0, "get": 0, "other": 0}
    for line in lines:
        found = REQUEST.search(line)
        if not found:
            continue
        method, target = found.groups()
        if method == "GET" and "list-type=2" in target:
            kinds["list"] += 1
        elif method == "GET" and target.startswith(f"/{BUCKET}/") and "?" not in target:
            kinds["get"] += 1
        else:
            kinds["other"] += 1
    return kinds


def build(scale, args: list[str], log: Path) -> dict:
    wall, rss, text = scale.run_cli(args, log)
    summary = json.loads(text)
    stages = {s["stage"]: s for s in summary["stages"]}
    return {"wall": wall, "rss": rss, "ingest_s": stages["ingest"]["seconds"], "inputs": summary["inputs"],
            "accepted": summary["accepted"], "stages": stages}


def image_ids(out: Path) -> list[str]:
    from storage import Artifact

    return sorted(Artifact(str(out / "build-secmm" / "demo" / "images")).to_pandas(["image_id"]).image_id)


def main() -> None:
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10000)
    parser.add_argument("--workdir", default="/tmp/rde-s3-inputs")
    parser.add_argument("--caption-sample", type=int, default=16, help="queries.caption_sample_per_domain")
    parser.add_argument("--rounds", type=int, default=2, help="queries.max_rounds")
    args = parser.parse_args()
    import fsspec
    import scale
    from s3_server import moto_s3

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    pool, folder = work / f"pool-{args.n}", work / f"images-{args.n}"
    if not (pool / "_manifest.json").exists():
        scale.run_cli(["pool", "synth", "--n", str(args.n), "--out", str(pool)], work / "synth.log")
    n = export_folder(pool, folder)
    common = ["--until", "candidates", "--json", "--set", f"queries.caption_sample_per_domain={args.caption_sample}",
              "--set", f"queries.max_rounds={args.rounds}"]
    local = build(scale, ["build-secmm", "--input", str(folder), "--input-kind", "folder",
                          "--output", str(work / "out-local"), *common], work / "build-local.log")
    print(f"local folder: {local['wall']:.0f} s, ingest {local['ingest_s']:.1f} s", flush=True)
    server_log = work / "moto.log"
    with open(server_log, "wb") as log, moto_s3((BUCKET,), log=log):
        fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
        start = time.perf_counter()
        fs.put(str(folder) + "/", f"{BUCKET}/images/", recursive=True)
        upload_s = time.perf_counter() - start
        log.flush()
        before = server_log.stat().st_size
        remote = build(scale, ["build-secmm", "--input", f"s3://{BUCKET}/images/", "--input-kind", "folder",
                               "--output", str(work / "out-s3"), *common], work / "build-s3.log")
        log.flush()
    with open(server_log, "rb") as handle:
        handle.seek(before)
        requests = classify(handle.read().decode(errors="replace").splitlines())
    same = image_ids(work / "out-local") == image_ids(work / "out-s3")
    rows = [("wall (s)", f"{local['wall']:.0f}", f"{remote['wall']:.0f}", f"{remote['wall'] / local['wall']:.2f}"),
            ("ingest stage (s)", f"{local['ingest_s']:.1f}", f"{remote['ingest_s']:.1f}",
             f"{remote['ingest_s'] / max(local['ingest_s'], 1e-9):.2f}"),
            ("ingest images/s", f"{n / local['ingest_s']:.0f}", f"{n / remote['ingest_s']:.0f}", "-"),
            ("peak RSS (GiB)", f"{local['rss'] / 2**30:.2f}", f"{remote['rss'] / 2**30:.2f}",
             f"{remote['rss'] / local['rss']:.2f}"),
            ("inputs / accepted by denoise", f"{local['inputs']} / {local['accepted']}",
             f"{remote['inputs']} / {remote['accepted']}", "same image ids" if same else "DIFFERENT image ids"),
            ("requests per image", "-", f"{sum(requests.values()) / n:.3f}", "-"),
            ("listing pages / object GETs / other", "-",
             f"{requests['list']} / {requests['get']} / {requests['other']}", "-")]
    print(f"\nN = {n} images; upload to moto {upload_s:.0f} s (not part of either run)\n")
    print("| | local folder | s3:// (moto) | s3 / local |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    (work / "result.json").write_text(json.dumps({"n": n, "local": local, "s3": remote, "requests": requests,
                                                  "same_images": same, "upload_s": upload_s}, default=str))
    if not same or local["accepted"] != remote["accepted"]:
        raise SystemExit("the two inputs did not give the same images")


if __name__ == "__main__":
    main()

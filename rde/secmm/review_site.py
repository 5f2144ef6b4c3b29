"""The review site (DSMM-TBIR Phase 3 at the paper's scale): static files that open from disk.

A benchmark's review is a folder, written in memory bounded by one query's candidates:

* ``index.html``: the whole app (one document, so one browser store on ``file://`` in every
  browser). Its views are the index of queries with progress, and one query at a time with its
  candidates in pages (``#q/<n>/<page>``).
* ``data/index.js``: the queries (id, text, domain, candidate count).
* ``data/q<n>.js``: one query's candidates in review order (``labels.review_order``: retrieved by
  more experts, then by a better best rank, first), each with its thumbnail's file name and the
  decision already imported for it, if any. Loaded by a ``<script>`` tag when the query is opened:
  ``fetch`` is not allowed on ``file://``.
* ``images/<image_id>.jpg|png``: the thumbnails, written once as files (never embedded), shared by
  the page and Label Studio.

Decisions are saved in the browser's IndexedDB as they are made (one record per pair, with its time
and annotator), exported as the decisions JSON that ``rde labels import`` reads, and resumed from
such a file. Decisions already imported into the run are shown as decided when the review is
rebuilt, so nothing a person decided is lost.
"""

from __future__ import annotations

import html
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fsspec.implementations.local import LocalFileSystem
from PIL import Image

from storage.filesystem import atomic_write_bytes

APP_TEMPLATE = Path(__file__).with_name("review_app.html")
_LOCAL = LocalFileSystem()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ReviewQuery:
    """One query and its candidates in review order (dicts with image_id, experts, best_rank)."""

    query_id: str
    text: str
    domain: str
    candidates: list[dict[str, Any]]


def thumbnail(data: bytes, height: int) -> tuple[bytes, str]:
    """The image at most ``height`` pixels tall and its file extension. One already within that
    height keeps its own bytes (JPEG or PNG as it came); a taller one is scaled down (Lanczos, the
    aspect ratio kept) and saved as JPEG, quality 90."""
    with Image.open(io.BytesIO(data)) as img:
        if img.height <= height:
            return data, (".png" if data[:8] == PNG_MAGIC else ".jpg")
        width = max(1, round(img.width * height / img.height))
        small = img.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=90)
    return out.getvalue(), ".jpg"


def write_thumbnails(gallery_rows: Iterable[dict[str, Any]], folder: Path, height: int) -> dict[str, str]:
    """Each gallery image as ``folder/<image_id>.<ext>`` (``thumbnail``), written once: a file that
    is already there is kept, unless it was made for another height (``.thumbnail_height`` says
    which), when the folder's images are made again. Returns image id → file name."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / ".thumbnail_height"
    if stamp.exists() and stamp.read_text().strip() != str(height):
        for old in [*folder.glob("*.jpg"), *folder.glob("*.png")]:
            old.unlink()
    _write_text(stamp, f"{height}\n")
    names: dict[str, str] = {}
    for row in gallery_rows:
        image_id = row["image_id"]
        found = [p for p in (folder / f"{image_id}.jpg", folder / f"{image_id}.png") if p.exists()]
        if found:
            names[image_id] = found[0].name
            continue
        data, ext = thumbnail(row["image_bytes"], height)
        _write_bytes(folder / f"{image_id}{ext}", data)  # a killed build leaves no half-written thumbnail
        names[image_id] = f"{image_id}{ext}"
    return names


def query_groups(candidate_rows: Iterable[dict[str, Any]], queries: dict[str, dict[str, Any]]
                 ) -> Iterator[ReviewQuery]:
    """The candidates one query at a time, each query's in review order. MECF writes a query's
    candidates together; a query that comes back after another one is an error, since holding every
    query's candidates at once would make memory grow with the benchmark."""
    from rde.secmm.labels import review_order

    done: set[str] = set()
    current: list[dict[str, Any]] = []

    def flush() -> ReviewQuery:
        qid = current[0]["query_id"]
        done.add(qid)
        q = queries[qid]
        return ReviewQuery(qid, q["text"], q["domain"], review_order(current))

    for row in candidate_rows:
        if current and row["query_id"] != current[0]["query_id"]:
            yield flush()
            current = []
        if row["query_id"] in done:
            raise ValueError(f"the candidates of query {row['query_id']} are not together: the review is built "
                             "one query at a time from candidates grouped by query, as MECF writes them")
        current.append(row)
    if current:
        yield flush()


def _script(call: str, payload: Any) -> str:
    """A data file that hands ``payload`` to the app: ``RDE_REVIEW.<call>(<json>);``. ``</`` is
    escaped so no text can close a script element."""
    return f"RDE_REVIEW.{call}({json.dumps(payload, ensure_ascii=False, separators=(',', ':'))});\n".replace(
        "</", "<\\/")


def write_review_site(folder: Path, title: str, key: str, groups: Iterable[ReviewQuery],
                      thumbs: dict[str, str], imported: dict[tuple[str, str], dict[str, Any]],
                      page_size: int) -> dict[str, int]:
    """The app, its index and one data file per query (module docstring). ``key`` names the
    benchmark's candidates, so the browser keeps separate decisions for separate benchmarks;
    ``imported`` is the decisions artifact's rows by pair. Returns counts and byte sizes."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    index: list[dict[str, Any]] = []
    largest = total_bytes = candidates = 0
    for n, group in enumerate(groups, start=1):
        rows = []
        for c in group.candidates:
            row: list[Any] = [c["image_id"], thumbs[c["image_id"]], ", ".join(c["experts"]), int(c["best_rank"])]
            made = imported.get((group.query_id, c["image_id"]))
            if made is not None:
                row.append(["accept" if made["relevant"] else "reject", made.get("decided_at") or "",
                            made.get("annotator") or "", made.get("tool") or ""])
            rows.append(row)
        text = _script("query", {"n": n, "id": group.query_id, "text": group.text, "domain": group.domain,
                                 "candidates": rows})
        _write_text(data / f"q{n}.js", text)
        size = len(text.encode())
        largest, total_bytes, candidates = max(largest, size), total_bytes + size, candidates + len(rows)
        index.append({"n": n, "id": group.query_id, "text": group.text, "domain": group.domain,
                      "count": len(rows), "imported": sum(len(r) > 4 for r in rows)})
    for stale in data.glob("q*.js"):  # queries of an earlier build that this one does not have
        if stale.stem[1:].isdigit() and int(stale.stem[1:]) > len(index):
            stale.unlink()
    (folder / "review.html").unlink(missing_ok=True)  # the single-file page of earlier versions
    index_text = _script("index", {"title": title, "key": key, "page_size": page_size, "total": candidates,
                                   "queries": index})
    _write_text(data / "index.js", index_text)
    app = APP_TEMPLATE.read_text(encoding="utf-8").replace("{{TITLE}}", html.escape(title))
    _write_text(folder / "index.html", app)
    return {"queries": len(index), "candidates": candidates, "largest_query_file_bytes": largest,
            "data_bytes": total_bytes + len(index_text.encode()), "index_bytes": len(index_text.encode()),
            "app_bytes": len(app.encode())}


def _write_bytes(path: Path, data: bytes) -> None:
    """Atomically (``storage.filesystem.atomic_write_bytes``: a temporary sibling renamed over it)."""
    atomic_write_bytes(_LOCAL, str(path), data, str(os.getpid()))


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode("utf-8"))


@dataclass(frozen=True)
class ReviewFiles:
    """Where a benchmark's review goes and how it is cut: candidates per page and per Label Studio
    task, the thumbnails' height, and the base URL Label Studio reads images from (None: its
    local-files serving of ``folder/images`` on this machine, paths relative to ``/``)."""

    folder: Path
    title: str
    key: str
    page_size: int = 48
    thumbnail_height: int = 256
    label_studio_images: str | None = None

    def image_url(self, names: dict[str, str]) -> Callable[[str], str]:
        """Image id → the URL a Label Studio task shows it by."""
        if self.label_studio_images:
            base = self.label_studio_images.rstrip("/")
            return lambda image_id: f"{base}/{quote(names[image_id])}"
        root = (self.folder / "images").resolve()
        return lambda image_id: "/data/local-files/?d=" + quote(str(root / names[image_id]).lstrip("/"))


def build_review(files: ReviewFiles, candidate_rows: Iterable[dict[str, Any]], queries: dict[str, dict[str, Any]],
                 gallery_rows: Iterable[dict[str, Any]], imported: dict[tuple[str, str], dict[str, Any]]
                 ) -> dict[str, int]:
    """The whole review folder in one pass over the candidates, one query at a time: thumbnails,
    the review site, and Label Studio's tasks (``label_studio_tasks.json``, streamed) and config.
    Memory: the largest query's candidates, the thumbnails' names and the imported decisions."""
    from rde.secmm import labels

    thumbs = write_thumbnails(gallery_rows, files.folder / "images", files.thumbnail_height)
    image_url = files.image_url(thumbs)
    tasks_path = files.folder / "label_studio_tasks.json"
    tmp = tasks_path.with_name(tasks_path.name + ".tmp")
    counts = {"label_studio_tasks": 0}
    with tmp.open("w", encoding="utf-8") as out:
        out.write("[")

        def with_tasks(groups: Iterable[ReviewQuery]) -> Iterator[ReviewQuery]:
            for group in groups:
                for task in labels.label_studio_tasks(group.query_id, group.text, group.domain, group.candidates,
                                                      files.page_size, image_url):
                    out.write(("\n" if counts["label_studio_tasks"] == 0 else ",\n") + json.dumps(task))
                    counts["label_studio_tasks"] += 1
                yield group

        site = write_review_site(files.folder, files.title, files.key,
                                 with_tasks(query_groups(candidate_rows, queries)), thumbs, imported,
                                 files.page_size)
        out.write("\n]\n")
    tmp.replace(tasks_path)
    _write_text(files.folder / "label_config.xml", labels.LABEL_STUDIO_CONFIG)
    return {**site, **counts, "images": len(thumbs)}

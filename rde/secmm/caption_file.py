"""A user's caption file (CUHK-PEDES-style JSON) as caption-pool rows: the pool's captions when the
profile names one instead of captioning the pool."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def file_caption_count(path: Path) -> int:
    """The captions a caption file lists, counted apart from the rows made of them (the caption
    pool's input on that path: each ends as one row)."""
    return sum(len(item.get("captions", [])) for item in json.loads(path.read_text(encoding="utf-8")))


def captions_from_file(path: Path, domain: str) -> list[dict[str, Any]]:
    """CUHK-PEDES-style JSON: a list of {"file_path" or "id", "captions": [...], optional "domain"}."""
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = []
    for item in data:
        for i, text in enumerate(item.get("captions", [])):
            ident = str(item.get("id", item.get("file_path", len(rows))))
            rows.append({"image_id": f"{ident}#{i}", "domain": item.get("domain", domain), "text": text,
                         "q_txt": None, "generator": "caption-file", "prompt": path.name})
    return rows

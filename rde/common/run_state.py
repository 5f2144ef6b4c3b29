"""What a run left in its output folder: which artifacts are complete and which were cut.

A stage writes its shards one by one (each atomically) and its manifest last, so a folder with
shards and no manifest is a stage that was stopped part way: its shards are whole and a rerun
reuses them. Read from the files alone, so it works after any stop, SIGKILL included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from storage import Artifact
from storage.artifact import SHARD_PATTERN, shard_name


@dataclass(frozen=True)
class FolderState:
    """One artifact folder: its path under the root, rows and shards written, and whether its
    manifest says it is complete (``kind`` is the manifest's; None for a cut stage)."""

    name: str
    kind: str | None
    rows: int
    shards: int
    complete: bool


def _shard_rows(folder: Path) -> tuple[int, int]:
    """Rows and shards of the whole shard files in ``folder`` (the artifact's own listing of the
    shards written; rows from their footers)."""
    indices = Artifact(str(folder)).written_indices()
    rows = 0
    for index in indices:
        try:
            rows += pq.ParquetFile(folder / shard_name(index)).metadata.num_rows
        except (OSError, ValueError):
            continue  # not readable as Parquet: not counted
    return rows, len(indices)


def folder_states(root: str | Path) -> list[FolderState]:
    """Every artifact folder under a local ``root``, sorted by path: complete ones from their
    manifests, cut ones (shards, no manifest) from their shard files. Empty for a missing root."""
    base = Path(root)
    if not base.is_dir():
        return []
    folders = {p.parent for p in base.rglob("_manifest.json")}
    folders |= {p.parent for p in base.rglob("part-*.parquet") if SHARD_PATTERN.match(p.name)}
    states = []
    for folder in sorted(folders):
        name = str(folder.relative_to(base))
        if (folder / "_manifest.json").exists():
            art = Artifact(str(folder))
            m = art.manifest()
            states.append(FolderState(name, m.kind, m.total_rows, len(m.shards), art.is_complete()))
        else:
            rows, shards = _shard_rows(folder)
            states.append(FolderState(name, None, rows, shards, False))
    return states


def stop_summary(root: str | Path) -> str:
    """One clause on what a stopped run leaves: complete artifacts, and cut ones with their shards."""
    states = folder_states(root)
    done = [s.name for s in states if s.complete]
    cut = [f"{s.name} ({s.shards} shard{'s' if s.shards != 1 else ''} written)" for s in states if not s.complete]
    parts = [f"complete: {', '.join(done) if done else 'nothing yet'}"]
    if cut:
        parts.append(f"cut: {', '.join(cut)}")
    return "; ".join(parts)

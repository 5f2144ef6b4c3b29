"""Precomputed rankings (``--model scores:FILE``): a model we cannot run, scored from its file.

Two formats, told apart by their first bytes (Parquet files start with ``PAR1``):

* a TREC run file: one ``qid Q0 docid rank score tag`` line per ranked item, whitespace separated;
* Parquet with columns ``query_id``, ``item_id``, ``score`` (other columns are ignored).

``read_scores`` keeps the rows whose query and item the benchmark knows; rows naming an unknown
query or an unknown item are counted (rows, distinct ids, the first few) for the report, not
evaluated. A (query, item) pair listed twice, a NaN score, a malformed line and a file with no
known row are errors (``ScoresFileError``, one line).

``write_trec_run`` and ``write_scores_parquet`` write a model's scores so that reading them back
gives the same floats: TREC scores are written with ``repr(float(score))`` (the shortest text that
reads back as the same float64; a float32 score is first widened exactly to float64), Parquet
scores as float64 of the given values. Either way a float32 score ``s`` reads back as
``float(s)``, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

EXAMPLES = 5  # unknown ids shown per kind


class ScoresFileError(ValueError):
    """A scores file that cannot be evaluated; the message is one line naming the file."""


@dataclass(frozen=True)
class Unknown:
    """Rows naming ids the benchmark does not know: how many rows, how many distinct ids, the first few."""

    rows: int = 0
    distinct: int = 0
    examples: tuple[str, ...] = ()


@dataclass
class ScoresRead:
    """The known rows of a scores file (``frame``: ``query_id``, ``item_id`` as str, ``score`` as
    float64, ``query_index``/``item_index`` their positions in the ids ``read_scores`` was given),
    with the rows left out because they name an unknown query or an unknown item (counted apart: a
    row naming both counts in both)."""

    path: str
    format: str  # trec | parquet
    frame: pd.DataFrame
    rows: int  # rows in the file
    unknown_queries: Unknown = field(default_factory=Unknown)
    unknown_items: Unknown = field(default_factory=Unknown)
    tags: tuple[str, ...] = ()  # a TREC run's tags

    def matrix(self, queries: int, items: int, fill: float = -math.inf) -> np.ndarray:
        """A ``queries`` × ``items`` float64 score matrix (the positions of the ids read against), with
        ``fill`` where the file ranks no score."""
        out = np.full((queries, items), fill, dtype=np.float64)
        out[self.frame["query_index"].to_numpy(), self.frame["item_index"].to_numpy()] = self.frame["score"].to_numpy()
        return out

    def triples(self) -> Iterator[tuple[str, str, float]]:
        """The known rows as (query_id, item_id, score), in file order."""
        yield from zip(self.frame["query_id"].tolist(), self.frame["item_id"].tolist(),
                       self.frame["score"].tolist(), strict=True)

    def stats(self) -> dict[str, Any]:
        """The counts as plain data (a stage's stats, a report): rows read and evaluated, and per
        kind of unknown id its rows, distinct ids and examples."""
        out: dict[str, Any] = {"scores_rows": self.rows, "scores_evaluated": len(self.frame)}
        for what, unknown in (("queries", self.unknown_queries), ("items", self.unknown_items)):
            out |= {f"unknown_{what}_rows": unknown.rows, f"unknown_{what}": unknown.distinct,
                    f"unknown_{what}_examples": list(unknown.examples)}
        return out

    def summary(self) -> str:
        """One line for the report: rows read, kept, and the unknown ones with examples."""
        parts = [f"{Path(self.path).name}: {self.rows} rows, {len(self.frame)} evaluated"]
        for what, unknown in (("queries", self.unknown_queries), ("items", self.unknown_items)):
            if unknown.rows:
                parts.append(f"{unknown.rows} naming {unknown.distinct} unknown {what} "
                             f"(e.g. {', '.join(unknown.examples)})")
        return "; ".join(parts)


def _is_parquet(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4) == b"PAR1"


def _read_trec(path: Path) -> tuple[pd.DataFrame, tuple[str, ...]]:
    qids, items, ranks, scores, tags = [], [], [], [], set()
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 6:
                raise ScoresFileError(f"scores file {path}: line {number} has {len(fields)} fields, a TREC run line "
                                      "has 6 (qid Q0 docid rank score tag)")
            try:
                rank, score = int(fields[3]), float(fields[4])
            except ValueError:
                raise ScoresFileError(f"scores file {path}: line {number}: rank {fields[3]!r} or score {fields[4]!r} "
                                      "is not a number") from None
            qids.append(fields[0])
            items.append(fields[2])
            ranks.append(rank)
            scores.append(score)
            tags.add(fields[5])
    frame = pd.DataFrame({"query_id": pd.Series(qids, dtype=object), "item_id": pd.Series(items, dtype=object),
                          "rank": np.asarray(ranks, dtype=np.int64), "score": np.asarray(scores, dtype=np.float64)})
    return frame, tuple(sorted(tags))


def _read_parquet(path: Path) -> pd.DataFrame:
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    missing = [c for c in ("query_id", "item_id", "score") if c not in names]
    if missing:
        raise ScoresFileError(f"scores file {path}: Parquet columns {missing} missing (has {names}; needs "
                              "query_id, item_id, score)")
    table = pq.read_table(path, columns=["query_id", "item_id", "score"])
    frame = table.to_pandas()
    try:
        score = frame["score"].to_numpy(dtype=np.float64)
    except (TypeError, ValueError):
        raise ScoresFileError(f"scores file {path}: column score is {table.schema.field('score').type}, "
                              "not a number") from None
    return pd.DataFrame({"query_id": frame["query_id"].astype(str).astype(object),
                         "item_id": frame["item_id"].astype(str).astype(object), "score": score})


def _unknown(ids: pd.Series, mask: np.ndarray) -> Unknown:
    if not mask.any():
        return Unknown()
    named = pd.unique(ids[mask])
    return Unknown(rows=int(mask.sum()), distinct=len(named), examples=tuple(str(i) for i in named[:EXAMPLES]))


def read_scores(path: str | Path, query_ids: Sequence[str], item_ids: Sequence[str]) -> ScoresRead:
    """The rows of a TREC run or Parquet scores file whose query is one of ``query_ids`` and whose
    item is one of ``item_ids`` (ids compared as strings), with the others counted."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ScoresFileError(f"scores file: no such file or folder: {path}")
    parquet = _is_parquet(path)
    frame, tags = (_read_parquet(path), ()) if parquet else _read_trec(path)
    if frame.empty:
        raise ScoresFileError(f"scores file {path}: no rows")
    nan = np.isnan(frame["score"].to_numpy())
    if nan.any():
        first = frame[nan].iloc[0]
        raise ScoresFileError(f"scores file {path}: {int(nan.sum())} NaN scores, e.g. query {first['query_id']} "
                              f"item {first['item_id']}")
    duplicated = frame.duplicated(["query_id", "item_id"])
    if duplicated.any():
        first = frame[duplicated].iloc[0]
        raise ScoresFileError(f"scores file {path}: {int(duplicated.sum())} duplicate (query, item) rows, e.g. "
                              f"({first['query_id']}, {first['item_id']})")
    query_at = {str(q): k for k, q in enumerate(query_ids)}
    item_at = {str(i): k for k, i in enumerate(item_ids)}
    query_index = frame["query_id"].map(query_at)
    item_index = frame["item_id"].map(item_at)
    bad_query, bad_item = query_index.isna().to_numpy(), item_index.isna().to_numpy()
    known = ~(bad_query | bad_item)
    if not known.any():
        raise ScoresFileError(f"scores file {path}: none of its {len(frame)} rows names a query and an item of the "
                              f"benchmark (e.g. query {frame['query_id'].iloc[0]}, item {frame['item_id'].iloc[0]})")
    kept = frame[known].copy()
    kept["query_index"] = query_index[known].astype(np.int64).to_numpy()
    kept["item_index"] = item_index[known].astype(np.int64).to_numpy()
    return ScoresRead(str(path), "parquet" if parquet else "trec", kept.reset_index(drop=True), len(frame),
                      _unknown(frame["query_id"], bad_query), _unknown(frame["item_id"], bad_item), tags)


def _token(value: object, what: str) -> str:
    text = str(value)
    if not text or len(text.split()) != 1 or text != text.strip():
        raise ValueError(f"TREC run: {what} {text!r} is empty or holds whitespace")
    return text


def write_trec_run(path: str | Path, rows: Iterable[tuple[str, str, int, float]], tag: str) -> int:
    """Write ``(query_id, item_id, rank, score)`` rows as a TREC run file tagged ``tag`` (a path or an
    fsspec URL, written atomically); returns the number of rows. Scores are written exactly (``repr``
    of the float64 value)."""
    import os

    from storage.filesystem import atomic_write_bytes, resolve

    tag = _token(tag, "tag")
    lines = [f"{_token(q, 'query id')} Q0 {_token(i, 'item id')} {int(rank)} {float(score)!r} {tag}\n"
             for q, i, rank, score in rows]
    fs, target = resolve(str(path))
    atomic_write_bytes(fs, target, "".join(lines).encode("utf-8"), f"{os.getpid()}")
    return len(lines)


def ranked_rows(query_ids: Sequence[str], item_ids: Sequence[str], scores: np.ndarray,
                top: int | None = None) -> list[tuple[str, str, int, float]]:
    """A score matrix as TREC rows: per query its items by descending score (ties: the earlier item
    first), ranks from 1, the ``top`` best only (all by default); NaN scores are left out."""
    scores = np.asarray(scores)
    rows = []
    for q, row in zip(query_ids, scores, strict=True):
        order = [k for k in np.argsort(-row, kind="stable") if not np.isnan(row[k])][:top]
        rows += [(str(q), str(item_ids[k]), rank, float(row[k])) for rank, k in enumerate(order, 1)]
    return rows


def write_scores_parquet(path: str | Path, query_ids: Sequence[str], item_ids: Sequence[str],
                         scores: np.ndarray) -> int:
    """Write a ``len(query_ids)`` × ``len(item_ids)`` score matrix as Parquet rows (query_id, item_id,
    score as float64 of the given values); NaN entries (not scored) are left out. Returns the rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    scores = np.asarray(scores)
    if scores.shape != (len(query_ids), len(item_ids)):
        raise ValueError(f"scores of shape {scores.shape} for {len(query_ids)} queries × {len(item_ids)} items")
    q, i = np.nonzero(~np.isnan(scores))
    table = pa.table({"query_id": pa.array([str(query_ids[k]) for k in q], pa.string()),
                      "item_id": pa.array([str(item_ids[k]) for k in i], pa.string()),
                      "score": pa.array(scores[q, i].astype(np.float64), pa.float64())})
    pq.write_table(table, path)
    return table.num_rows

"""Label refinement (DSMM-TBIR Phase 3): people verify the MECF candidates.

Two export forms, one import:

* a Label Studio import file (tasks with the query, the image path and ids; choices
  relevant / not relevant) plus its labelling config;
* a self-contained HTML review page: thumbnails grouped per query, click or keyboard to accept or
  reject, "Export" downloads a decisions JSON file;
* ``import_decisions`` reads either export (the page's JSON or Label Studio's JSON export),
  validates every (query, image) against the candidates, and returns decisions with who, when and
  from which tool.

Conflicting decisions on one pair (two reviewers, or one who changed their mind) are resolved by
one rule, ``latest_per_pair``: the latest ``decided_at`` wins; on equal times, the one read last
(later in the file, or from the later import). A decision without a time is stamped with the time
of its import. Pairs whose decisions disagree are counted, so an import says how many it settled.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RELEVANT, NOT_RELEVANT = "relevant", "not_relevant"
LABEL_STUDIO_CONFIG = """<View>
  <Header value="$query"/>
  <Image name="image" value="$image"/>
  <Choices name="relevance" toName="image" choice="single" showInLine="true">
    <Choice value="relevant" hotkey="1"/>
    <Choice value="not_relevant" hotkey="2"/>
  </Choices>
</View>
"""


class DecisionError(ValueError):
    """A decisions file cannot be imported; the message lists what is wrong."""


REVIEW_PAGE, LABEL_STUDIO = "review-page", "label-studio"  # a decision's tool


@dataclass(frozen=True)
class Decision:
    query_id: str
    image_id: str
    relevant: bool
    annotator: str
    decided_at: str
    tool: str = REVIEW_PAGE


def decided_time(decision: Decision) -> _dt.datetime:
    """``decided_at`` as an aware time (no zone: UTC; ``Z`` accepted); an unreadable one is the
    earliest time, so any dated decision on the pair wins over it."""
    try:
        when = _dt.datetime.fromisoformat(decision.decided_at.strip())
    except ValueError:
        return _dt.datetime.min.replace(tzinfo=_dt.UTC)
    return when if when.tzinfo else when.replace(tzinfo=_dt.UTC)


def latest_per_pair(decisions: Iterable[Decision]) -> tuple[list[Decision], int]:
    """One decision per (query, image): the latest ``decided_at``, ties to the one read last; and
    how many pairs had decisions that disagree (relevant and not relevant)."""
    by_pair: dict[tuple[str, str], list[tuple[_dt.datetime, int, Decision]]] = {}
    for order, d in enumerate(decisions):
        by_pair.setdefault((d.query_id, d.image_id), []).append((decided_time(d), order, d))
    kept = [max(found, key=lambda entry: (entry[0], entry[1]))[2] for found in by_pair.values()]
    conflicts = sum(1 for found in by_pair.values() if len({entry[2].relevant for entry in found}) > 1)
    return kept, conflicts


def review_order(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates in the order a reviewer sees them: queries as they come, and within a query
    the likely matches first: retrieved by more experts, then by a better (smaller) best rank."""
    first_seen: dict[str, int] = {}
    for c in candidates:
        first_seen.setdefault(c["query_id"], len(first_seen))
    return sorted(candidates, key=lambda c: (first_seen[c["query_id"]], -len(c["experts"]), int(c["best_rank"]),
                                             c["image_id"]))


def write_review_images(gallery: Iterable[dict[str, Any]], folder: Path) -> dict[str, Path]:
    """Gallery images as JPEG/PNG files named by image id (Label Studio serves files, not bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for row in gallery:
        data = row["image_bytes"]
        ext = ".png" if data[:8] == b"\x89PNG\r\n\x1a\n" else ".jpg"
        path = folder / f"{row['image_id']}{ext}"
        if not path.exists():
            path.write_bytes(data)
        paths[row["image_id"]] = path
    return paths


def label_studio_tasks(candidates: list[dict[str, Any]], queries: dict[str, dict[str, Any]],
                       image_urls: dict[str, str]) -> list[dict[str, Any]]:
    """Label Studio import tasks, one per candidate (query, image) pair."""
    tasks = []
    for i, c in enumerate(candidates):
        q = queries[c["query_id"]]
        tasks.append({"id": i + 1, "data": {
            "image": image_urls[c["image_id"]], "query": q["text"], "query_id": c["query_id"],
            "image_id": c["image_id"], "domain": c["domain"], "experts": ", ".join(c["experts"]),
            "best_rank": int(c["best_rank"])}})
    return tasks


def review_page(candidates: list[dict[str, Any]], queries: dict[str, dict[str, Any]],
                images: dict[str, bytes], title: str) -> str:
    """The self-contained HTML review page (thumbnails embedded as data URLs)."""
    template = Path(__file__).with_name("review_page.html").read_text(encoding="utf-8")
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in candidates:
        groups.setdefault(c["query_id"], []).append(c)
    sections = []
    for qid, cands in groups.items():
        q = queries[qid]
        tiles = []
        for c in cands:
            data = images[c["image_id"]]
            mime = "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
            src = f"data:{mime};base64,{base64.b64encode(data).decode()}"
            tip = html.escape(f"{c['image_id'][:12]} · experts: {', '.join(c['experts'])} · best rank {c['best_rank']}")
            image_id = html.escape(c["image_id"])
            tiles.append(f'<button class="tile" data-query="{html.escape(qid)}" data-image="{image_id}"'
                         f' title="{tip}"><img src="{src}" alt="candidate {image_id[:12]}">'
                         f'<span class="mark"></span></button>')
        sections.append(f'<section data-query="{html.escape(qid)}"><h2><span class="qid">{html.escape(qid)}</span> '
                        f'{html.escape(q["text"])} <small>({len(cands)} candidates)</small></h2>'
                        f'<div class="tiles">{"".join(tiles)}</div></section>')
    return (template.replace("{{TITLE}}", html.escape(title))
            .replace("{{COUNT}}", str(len(candidates)))
            .replace("{{SECTIONS}}", "\n".join(sections)))


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def import_decisions(path: Path, candidates: Iterable[tuple[str, str]]) -> list[Decision]:
    """One decision per pair (``latest_per_pair``) of ``read_decisions``."""
    return latest_per_pair(read_decisions(path, candidates))[0]


def read_decisions(path: Path, candidates: Iterable[tuple[str, str]]) -> list[Decision]:
    """Every decision of the review page's JSON or a Label Studio JSON export, in file order,
    validated against the candidate (query_id, image_id) pairs. Unknown pairs, unknown decision
    values and files of neither form are errors naming the offending entries."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DecisionError(f"decisions file {path} is not readable JSON: {exc}") from None
    known = set(candidates)
    if isinstance(data, dict) and "decisions" in data:
        decisions = _from_review_page(data)
    elif isinstance(data, list):
        decisions = _from_label_studio(data)
    else:
        raise DecisionError(f"decisions file {path}: expected the review page's export (an object with "
                            "'decisions') or a Label Studio JSON export (a list of tasks)")
    unknown = [f"({d.query_id}, {d.image_id})" for d in decisions if (d.query_id, d.image_id) not in known]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise DecisionError(f"decisions file {path}: {len(unknown)} decisions name pairs that are not candidates "
                            f"of this benchmark: {shown}")
    return decisions


def _parse_value(value: Any, where: str) -> bool:
    text = str(value).strip().lower()
    if text in ("accept", "accepted", "relevant", "yes", "true", "1"):
        return True
    if text in ("reject", "rejected", "not_relevant", "irrelevant", "no", "false", "0"):
        return False
    raise DecisionError(f"{where}: unknown decision {value!r} (use accept/reject or relevant/not_relevant)")


def _from_review_page(data: dict[str, Any]) -> list[Decision]:
    annotator = str(data.get("annotator") or "unknown")
    out = []
    for i, d in enumerate(data["decisions"]):
        try:
            out.append(Decision(str(d["query_id"]), str(d["image_id"]), _parse_value(d["decision"], f"decision {i}"),
                                str(d.get("annotator") or annotator), str(d.get("decided_at") or _now()),
                                REVIEW_PAGE))
        except KeyError as exc:
            raise DecisionError(f"decision {i} lacks {exc}") from None
    return out


def _from_label_studio(tasks: list[Any]) -> list[Decision]:
    out = []
    for i, task in enumerate(tasks):
        data = task.get("data", {}) if isinstance(task, dict) else {}
        if "query_id" not in data or "image_id" not in data:
            raise DecisionError(f"Label Studio task {i} has no data.query_id / data.image_id")
        for ann in task.get("annotations", []):
            if ann.get("was_cancelled"):
                continue
            choices = [c for r in ann.get("result", []) for c in r.get("value", {}).get("choices", [])]
            if not choices:
                continue
            who = ann.get("completed_by")
            who = who.get("email") if isinstance(who, dict) else who
            out.append(Decision(str(data["query_id"]), str(data["image_id"]),
                                _parse_value(choices[0], f"task {i}"), str(who or "label-studio"),
                                str(ann.get("updated_at") or ann.get("created_at") or _now()), LABEL_STUDIO))
    return out

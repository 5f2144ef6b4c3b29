"""Label refinement (DSMM-TBIR Phase 3): people verify the MECF candidates.

Two tools, one import:

* the review site (``review_site``): static pages, a query at a time, decisions kept in the
  browser and exported as a decisions JSON file;
* Label Studio: one task per query and page of its candidates (``label_studio_tasks``), the query
  text and a grid of candidate images to mark as matches (``LABEL_STUDIO_CONFIG``). A submitted
  annotation decides every candidate of its task: the marked ones are relevant, the others not.

``import_decisions`` reads either export (the page's JSON or Label Studio's JSON export),
validates every (query, image) against the candidates, and returns decisions with who, when and
from which tool.

Conflicting decisions on one pair (two reviewers, or one who changed their mind) are resolved by
one rule, ``latest_per_pair``: the latest ``decided_at`` wins; on equal times, the one read last
(later in the file, or from the later import). A decision without a time is stamped with the time
of its import. Pairs whose decisions disagree are counted, so an import says how many it settled.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RELEVANT, NOT_RELEVANT = "relevant", "not_relevant"
# A task: the query and a grid of its candidates (Label Studio's dynamic choices, each an image);
# the annotator marks the matches. The result names the marked image ids.
LABEL_STUDIO_CONFIG = """<View>
  <Header value="$heading"/>
  <Text name="query" value="$query"/>
  <Choices name="matches" toName="query" choice="multiple" layout="inline" value="$candidates"/>
</View>
"""
MATCHES = "matches"  # the Choices tag's name: the results to read back


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


def label_studio_tasks(query_id: str, text: str, domain: str, candidates: list[dict[str, Any]],
                       page_size: int, image_url: Callable[[str], str]) -> list[dict[str, Any]]:
    """One query's Label Studio tasks: its candidates (in review order) in pages of ``page_size``,
    each candidate a choice showing its image (``image_url(image_id)``) and saving its image id."""
    pages = [candidates[i:i + page_size] for i in range(0, len(candidates), page_size)]
    tasks = []
    for k, page in enumerate(pages, start=1):
        choices = [{"value": c["image_id"],
                    "html": f"<img src=\"{html.escape(image_url(c['image_id']))}\" height=\"128\" alt=\"\"/>",
                    "hint": f"experts: {', '.join(c['experts'])}; best rank {int(c['best_rank'])}"} for c in page]
        tasks.append({"data": {"heading": f"Mark every image that matches the query ({domain}, page {k} of "
                                          f"{len(pages)})", "query": text, "query_id": query_id, "domain": domain,
                               "page": k, "pages": len(pages), "candidates": choices}})
    return tasks


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
    """Decisions of a Label Studio JSON export. A task of a query's grid (``data.candidates``):
    each submitted annotation decides every candidate of the task, the marked ones relevant, the
    others not (an annotation with nothing marked says none match). A task of one pair
    (``data.image_id``, as written before grids): its annotation's choice."""
    out = []
    for i, task in enumerate(tasks):
        data = task.get("data", {}) if isinstance(task, dict) else {}
        if "query_id" not in data or ("image_id" not in data and "candidates" not in data):
            raise DecisionError(f"Label Studio task {i} has no data.query_id with data.candidates or data.image_id")
        for ann in task.get("annotations", []):
            if ann.get("was_cancelled"):
                continue
            who = ann.get("completed_by")
            who = str((who.get("email") if isinstance(who, dict) else who) or "label-studio")
            when = str(ann.get("updated_at") or ann.get("created_at") or _now())
            results = ann.get("result", [])
            if "candidates" in data:
                marked = {c for r in results if r.get("from_name", MATCHES) == MATCHES
                          for c in r.get("value", {}).get("choices", [])}
                shown = [str(c["value"] if isinstance(c, dict) else c) for c in data["candidates"]]
                stray = marked - set(shown)
                if stray:
                    raise DecisionError(f"Label Studio task {i}: marked images that are not among its candidates: "
                                        f"{', '.join(sorted(stray)[:5])}")
                out.extend(Decision(str(data["query_id"]), image, image in marked, who, when, LABEL_STUDIO)
                           for image in shown)
                continue
            choices = [c for r in results for c in r.get("value", {}).get("choices", [])]
            if choices:
                out.append(Decision(str(data["query_id"]), str(data["image_id"]),
                                    _parse_value(choices[0], f"task {i}"), who, when, LABEL_STUDIO))
    return out

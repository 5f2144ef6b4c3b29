"""What an evaluation produces, as plain data: a metric with its interval, one query's outcome, one
model's result, the comparison of several models on one benchmark. The terminal table, the Prefect
artifacts and the reports (``report.py``) all render these."""

from __future__ import annotations

from dataclasses import dataclass, field

# The metrics of a comparison, in the order tables show them (SecMM-TBIR reports mAP@10/20/30).
METRICS = ("mAP@10", "mAP@20", "mAP@30", "R@1", "R@5", "R@10", "mINP", "nDCG@10", "MRR")


@dataclass(frozen=True)
class Interval:
    """A mean over queries and its percentile-bootstrap interval (``level``, 95 % by default)."""

    mean: float
    low: float
    high: float


@dataclass(frozen=True)
class QueryOutcome:
    """One query's outcome for one model: its AP (at the comparison's headline cut-off: 20 when
    mAP@20 is among the cut-offs, else the first), the rank of its first relevant item in the full ranking (None when
    no relevant item was ranked), its top-ranked items and its relevant items."""

    query_id: str
    domain: str
    text: str
    ap: float
    first_hit: int | None
    top: tuple[str, ...]  # the top 5 item ids, best first
    relevant: tuple[str, ...]


@dataclass
class ModelResult:
    """One retriever on one benchmark: ``metrics[domain][metric]`` (domain ``all`` over every
    query), the number of queries scored per domain, the paired difference against the reference
    model per metric (over all queries; None for the reference itself or with one model)."""

    model: str  # the spec as written, e.g. ``transformers-clip:/models/clip``
    metrics: dict[str, dict[str, Interval]]
    queries: dict[str, int]
    per_query: list[QueryOutcome] = field(default_factory=list)
    difference: dict[str, Interval] | None = None
    run_file: str = ""  # its TREC run file (top 100), where written


@dataclass
class Comparison:
    """Several retrievers on one benchmark with one set of labels. ``labels`` is ``verified``,
    ``pending`` (the unreviewed MECF union: flagged in every table) or ``all``; ``review_links``
    maps a query id to its page on the benchmark's review site (absent when there is none)."""

    benchmark: str
    labels: str
    models: list[ModelResult]
    reference: str | None = None
    metrics: tuple[str, ...] = METRICS
    headline_k: int = 20
    review_links: dict[str, str] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        return self.labels != "verified"

    def title(self) -> str:
        """The comparison's title; unreviewed labels are said in it."""
        flag = "" if not self.pending else " · PENDING LABELS (unreviewed MECF candidates)"
        return f"{self.benchmark} · labels: {self.labels}{flag}"

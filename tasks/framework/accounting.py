"""What a stage did, counted: its result, and the checks that no row was lost.

A stage counts its input itself (images read, lines the generator returned, tiers asked for),
never as accepted + rejected. A stage that declares ``balance=True`` must then end every input
as one accepted or one rejected row: the lifecycle (``runner``) checks it per shard and in total
and raises ``AccountingError`` before anything is written as complete. Every rejected row's
reason must be a code of the one registry (``rde.common.reasons``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rde.common.reasons import unregistered


@dataclass
class StageResult:
    """What a stage did, for summaries and tables."""

    stage: str
    skipped: bool
    artifacts: dict[str, str]
    input_rows: int
    accepted: int
    rejected: dict[str, int] = field(default_factory=dict)
    shards: int = 0
    shards_resumed: int = 0
    seconds: float = 0.0
    # CPU seconds of the process that ran the stage (a fanned-out stage's parent: planning, watching, the
    # manifests; its shards' work is in the shard-range runs' processes)
    cpu_seconds: float = 0.0
    splits: dict[str, int] = field(default_factory=dict)  # accepted rows by split (train, held_out...)
    rejects_from_upstream: bool = False  # its rejected rows were gathered from earlier stages (counted there)
    balanced: bool | None = None  # input == accepted + rejected, checked by the runner; None: not a 1:1 stage
    # every stat the stage recorded in its manifests (the counts above and its extras: clusters, losses, ...),
    # so that its report reads them here, not from its own manifest on disk
    stats: dict[str, Any] = field(default_factory=dict)

    def summary_row(self) -> dict[str, Any]:
        """This stage's line in a run summary."""
        return {"stage": self.stage, "skipped": self.skipped, "input": self.input_rows, "accepted": self.accepted,
                "rejected": sum(self.rejected.values()), "shards": self.shards, "shards_reused": self.shards_resumed,
                "seconds": round(self.seconds, 2), "cpu_seconds": round(self.cpu_seconds, 2),
                "balanced": self.balanced}


class AccountingError(RuntimeError):
    """A stage lost (or invented) rows: its own input count differs from accepted + rejected."""


class UnregisteredReason(AccountingError):
    """A stage rejected rows with a reason code that ``rde.common.reasons`` does not list."""


def check_reasons(stage: str, stats: dict[str, Any], where: str = "") -> None:
    """Raise ``UnregisteredReason`` when a rejected reason is not in the one registry
    (rde/common/reasons.py's codes and those declared beside their logic with ``declare_reason``)."""
    unknown = unregistered(stats.get("rejected", {}))
    if unknown:
        raise UnregisteredReason(f"{stage}{where}: rejected rows with reason codes {unknown} that "
                                 "rde/common/reasons.py does not register (declare each with its one-line meaning: "
                                 "declare_reason in the module that writes it); "
                                 "nothing was marked complete")


def check_balance(stage: str, stats: dict[str, Any], where: str = "") -> bool:
    """Raise ``AccountingError`` unless ``input_rows == accepted + sum(rejected)``; True otherwise."""
    counted = int(stats.get("input_rows", 0))
    accepted, rejected = int(stats.get("accepted", 0)), sum(int(v) for v in stats.get("rejected", {}).values())
    if counted != accepted + rejected:
        gap = counted - accepted - rejected
        what = f"{gap} rows lost" if gap > 0 else f"{-gap} rows more than its input"
        raise AccountingError(f"{stage}{where}: {counted} inputs counted, but {accepted} accepted + {rejected} "
                              f"rejected = {accepted + rejected} ({what}); nothing was marked complete")
    return True



def reason_counts(rejects: pa.Table) -> dict[str, int]:
    counts: dict[str, int] = {}
    for reason in rejects.column("reason").to_pylist():
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def merge_counts(parts: Sequence[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total



def accepted_and_rejected(tables: dict[str, pa.Table], accepted: str, rejects: str | None = None
                          ) -> dict[str, Any]:
    """A shard's ``accepted`` rows and its ``rejects`` rows by reason, counted from its tables. Its
    input is not among them: a stage counts that from what it read (the sum of its outputs would
    balance by construction)."""
    return {"accepted": tables[accepted].num_rows, "rejected": reason_counts(tables[rejects]) if rejects else {}}


def sum_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-shard stats summed: counts and numeric extras added, rejected reasons merged."""
    total: dict[str, Any] = {"input_rows": 0, "accepted": 0, "rejected": {}}
    for part in parts:
        for key, value in part.items():
            if key == "rejected":
                total["rejected"] = merge_counts([total["rejected"], value])
            elif isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total

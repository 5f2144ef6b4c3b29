"""What every run summary shares: the gap lines, the balance marks, the markdown and its Prefect
artifact. A pipeline's flows build the summary itself (``tasks/pool/summary.py`` for the building flows)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from tasks.framework.accounting import StageResult
from tasks.framework.reporting import publish_markdown


def lost(gap: int) -> str:
    """How a gap reads: rows lost, or rows more than went in."""
    return f"{gap} rows lost" if gap > 0 else f"{-gap} rows more than went in"


def totals_gap(inputs: int, accepted: int, total_rejected: int) -> list[str]:
    """The chain's totals, when its accepted and rejected rows do not add up to its inputs."""
    if accepted + total_rejected == inputs:
        return []
    return [f"{inputs} inputs, but {accepted} accepted + {total_rejected} rejected = {accepted + total_rejected} "
            f"({lost(inputs - accepted - total_rejected)})"]


def chain_gaps(chain: list[StageResult]) -> dict[str, str]:
    """Each stage of the chain whose input differs from what the stage before it accepted, and by
    how much (a stage counts its input from what it read, so a gap is rows lost, or added, between
    the two: in the artifact after the earlier stage wrote it)."""
    gaps = {}
    for before, after in pairwise(chain):
        if after.input_rows != before.accepted:
            gaps[after.stage] = (f"{after.stage}: {after.input_rows} inputs, but {before.stage} accepted "
                                 f"{before.accepted} ({lost(before.accepted - after.input_rows)} between the "
                                 "two stages)")
    return gaps


def unbalanced_message(summary: dict[str, Any]) -> str:
    """What the CLI says when a run's accounting does not add up: the summary's ``imbalance``, or
    (a summary without it) its accounting line."""
    from tasks.framework.reporting import accounting_line

    found = summary.get("imbalance") or [f"{accounting_line(summary)} does not add up"]
    return f"accounting mismatch: {'; '.join(found)} (see the summary above)"


def balance_mark(balanced: bool | None) -> str:
    """A stage's balance check as shown: checked and true, FAILED (in a run summary: its input is not
    what the stage before it accepted), or ``–``: not a one-row-per-input stage."""
    return "checked" if balanced else ("FAILED" if balanced is False else "–")


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['flow']} ({summary['profile']})", "",
             f"Inputs **{summary['inputs']}**, accepted **{summary['accepted']}**, "
             f"rejected **{summary['total_rejected']}**, balanced: **{summary['balanced']}**", "",
             *[f"- not balanced: {line}" for line in summary.get("imbalance", [])],
             *[f"- domain {name}: no images accepted, nothing built for it"
               for name in summary.get("empty_domains", [])],
             "| stage | skipped | input | accepted | rejected | shards | reused | seconds | balance |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary["stages"]:
        lines.append(f"| {s['stage']} | {s['skipped']} | {s['input']} | {s['accepted']} | {s['rejected']} | "
                     f"{s['shards']} | {s['shards_reused']} | {s['seconds']} | {balance_mark(s.get('balanced'))} |")
    lines += ["", "| rejected rows by stage:reason | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(summary["rejected"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| artifact | rows | location |", "|---|---|---|"]
    lines += [f"| {k} | {v['rows']} | `{v['url']}` |" for k, v in summary["artifacts"].items()]
    return "\n".join(lines)


def publish_summary(flow_name: str, summary: dict[str, Any]) -> None:
    publish_markdown(f"{flow_name}-summary", summary_markdown(summary), f"{flow_name} run summary")

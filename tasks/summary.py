"""Run summary: stage outcomes, accounting (accepted + rejected = input) and artifact locations."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from storage import Artifact
from tasks.context import RunContext
from tasks.reporting import publish_markdown
from tasks.sharded import StageResult

POOL_STAGES = ("ingest", "measure", "denoise")  # the image chain: inputs = accepted + rejected over these


def run_summary(ctx: RunContext, stages: list[StageResult]) -> dict[str, Any]:
    """Totals across stages; ``balanced`` asserts that no input was lost. ``rejected`` holds every
    stage's reasons (``stage:reason``; a stage that only gathers earlier stages' rejects is not
    counted twice), ``total_rejected`` the images rejected along the image chain (ingest, measure,
    denoise) and ``accepted`` those the last of its stages that ran kept (``--until ingest`` too).
    ``imbalance`` says what does not add up (empty when balanced): the chain's totals, and each of
    its stages whose input is not what the stage before it accepted (that stage's row shows
    ``balanced: False``): each stage balances its own rows, so rows lost between two stages show
    only here."""
    by_name = {s.stage: s for s in stages}
    chain = [name for name in POOL_STAGES if name in by_name] or [stages[-1].stage]
    inputs = by_name[chain[0]].input_rows
    accepted = by_name[chain[-1]].accepted
    rejected: dict[str, int] = {}
    for stage in stages:
        if stage.rejects_from_upstream:
            continue
        for reason, count in stage.rejected.items():
            rejected[f"{stage.stage}:{reason}"] = rejected.get(f"{stage.stage}:{reason}", 0) + count
    total_rejected = sum(sum(by_name[name].rejected.values()) for name in chain)
    gaps = chain_gaps([by_name[name] for name in chain])
    imbalance = totals_gap(inputs, accepted, total_rejected) + list(gaps.values())
    videos = video_account(by_name)
    if videos and videos.get("gap"):
        imbalance.append(videos["gap"])
    artifacts = {}
    for stage in stages:
        for name, url in stage.artifacts.items():
            artifacts[f"{stage.stage}.{name}"] = {"url": url, "rows": Artifact(url).count_rows()}
    gallery = by_name.get("cgds")
    return {
        "gallery": gallery.accepted if gallery else None,
        "queries": by_name["dap"].accepted if "dap" in by_name else None,
        "flow": ctx.flow_name, "profile": ctx.profile.name, "output_root": ctx.root,
        "stages": [{**s.summary_row(), **({"balanced": False} if s.stage in gaps else {})} for s in stages],
        "inputs": inputs, "accepted": accepted, "rejected": rejected, "total_rejected": total_rejected,
        "balanced": not imbalance, "imbalance": imbalance, "artifacts": artifacts,
        **({"videos": videos} if videos else {}),
    }


def video_account(by_name: dict[str, StageResult]) -> dict[str, Any] | None:
    """For video input: videos in, accepted, rejected, and the crops they gave; ``gap`` says when
    ingest's inputs (counted from what it listed) are not the crops the videos stage wrote
    (counted from its artifact)."""
    videos = by_name.get("videos")
    if videos is None:
        return None
    crops = Artifact(videos.artifacts["crops"]).count_rows()
    account: dict[str, Any] = {"input": videos.input_rows, "accepted": videos.accepted,
                               "rejected": sum(videos.rejected.values()), "crops": crops}
    ingest = by_name.get("ingest")
    if ingest is not None and ingest.input_rows != crops:
        account["gap"] = (f"ingest: {ingest.input_rows} inputs, but the videos stage wrote {crops} crops "
                          f"({_lost(crops - ingest.input_rows)} between the two stages)")
    return account


def _lost(gap: int) -> str:
    return f"{gap} rows lost" if gap > 0 else f"{-gap} rows more than went in"


def totals_gap(inputs: int, accepted: int, total_rejected: int) -> list[str]:
    """The chain's totals, when its accepted and rejected rows do not add up to its inputs."""
    if accepted + total_rejected == inputs:
        return []
    return [f"{inputs} inputs, but {accepted} accepted + {total_rejected} rejected = {accepted + total_rejected} "
            f"({_lost(inputs - accepted - total_rejected)})"]


def chain_gaps(chain: list[StageResult]) -> dict[str, str]:
    """Each stage of the chain whose input differs from what the stage before it accepted, and by
    how much (a stage counts its input from what it read, so a gap is rows lost, or added, between
    the two: in the artifact after the earlier stage wrote it)."""
    gaps = {}
    for before, after in pairwise(chain):
        if after.input_rows != before.accepted:
            gaps[after.stage] = (f"{after.stage}: {after.input_rows} inputs, but {before.stage} accepted "
                                 f"{before.accepted} ({_lost(before.accepted - after.input_rows)} between the "
                                 "two stages)")
    return gaps


def unbalanced_message(summary: dict[str, Any]) -> str:
    """What the CLI says when a run's accounting does not add up: the summary's ``imbalance``, or
    (a summary without it) its accounting line."""
    from tasks.reporting import accounting_line

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

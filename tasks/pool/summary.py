"""The run summary of a building flow (build-secmm, build-largefine: flows that start with the pool
stages): stage outcomes, the image chain's accounting (accepted + rejected = input, and each
stage's input what the stage before it accepted), the videos' account and artifact locations."""

from __future__ import annotations

from typing import Any

from storage import Artifact
from tasks.framework.accounting import StageResult
from tasks.framework.context import RunContext
from tasks.framework.summary import chain_gaps, lost, totals_gap

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
            artifacts[name] = {"url": url, "rows": Artifact(url).count_rows()}
    gallery = by_name.get("cgds")
    domains = images_by_domain(ctx, artifacts)
    return {
        "gallery": gallery.accepted if gallery else None,
        "queries": by_name["dap"].accepted if "dap" in by_name else None,
        "flow": ctx.flow_name, "profile": ctx.profile.name, "output_root": ctx.root,
        "stages": [{**s.summary_row(), **({"balanced": False} if s.stage in gaps else {})} for s in stages],
        "inputs": inputs, "accepted": accepted, "rejected": rejected, "total_rejected": total_rejected,
        "balanced": not imbalance, "imbalance": imbalance, "artifacts": artifacts,
        **({"videos": videos} if videos else {}),
        **({"retried": retried} if (retried := retried_rejects(stages)) else {}),
        **({"domains": domains, "empty_domains": [d for d, n in domains.items() if n == 0]} if domains else {}),
    }


def retried_rejects(stages: list[StageResult]) -> dict[str, dict[str, int]]:
    """Per stage that retried its transient rejects in this run: the inputs retried and recovered."""
    return {s.stage: {"retried": int(s.stats["retried"]), "recovered": int(s.stats.get("recovered", 0))}
            for s in stages if not s.skipped and s.stats.get("retried")}


def images_by_domain(ctx: RunContext, artifacts: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Per domain of the profile, the images denoise accepted (empty before denoise ran): a domain
    the input does not show is said to be empty, not left out of the summary unnoticed."""
    accepted = artifacts.get("accepted")
    if accepted is None:
        return {}
    counts = dict.fromkeys(ctx.profile.domain_set.names, 0)
    source = Artifact(accepted["url"])
    for _, table in source.iter_shards(["domain"]):
        for name in table.column("domain").to_pylist():
            counts[name] = counts.get(name, 0) + 1
    return counts


def video_account(by_name: dict[str, StageResult]) -> dict[str, Any] | None:
    """For video input: videos in, accepted, rejected, and the crops they gave; ``gap`` says when
    ingest's inputs (counted from what it listed) are not the crops the videos stage wrote
    (counted from its artifact)."""
    videos = by_name.get("videos")
    if videos is None:
        return None
    crops = Artifact(videos.artifacts["video_crops"]).count_rows()
    account: dict[str, Any] = {"input": videos.input_rows, "accepted": videos.accepted,
                               "rejected": sum(videos.rejected.values()), "crops": crops}
    ingest = by_name.get("ingest")
    if ingest is not None and ingest.input_rows != crops:
        account["gap"] = (f"ingest: {ingest.input_rows} inputs, but the videos stage wrote {crops} crops "
                          f"({lost(crops - ingest.input_rows)} between the two stages)")
    return account



"""Run summary: stage outcomes, accounting (accepted + rejected = input) and artifact locations."""

from __future__ import annotations

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
    denoise) and ``accepted`` those the last of its stages that ran kept (``--until ingest`` too)."""
    by_name = {s.stage: s for s in stages}
    chain = [name for name in POOL_STAGES if name in by_name]
    inputs = by_name["ingest"].input_rows
    accepted = by_name[chain[-1]].accepted
    rejected: dict[str, int] = {}
    for stage in stages:
        if stage.rejects_from_upstream:
            continue
        for reason, count in stage.rejected.items():
            rejected[f"{stage.stage}:{reason}"] = rejected.get(f"{stage.stage}:{reason}", 0) + count
    total_rejected = sum(sum(by_name[name].rejected.values()) for name in chain)
    artifacts = {}
    for stage in stages:
        for name, url in stage.artifacts.items():
            artifacts[f"{stage.stage}.{name}"] = {"url": url, "rows": Artifact(url).count_rows()}
    gallery = by_name.get("cgds")
    return {
        "gallery": gallery.accepted if gallery else None,
        "queries": by_name["dap"].accepted if "dap" in by_name else None,
        "flow": ctx.flow_name, "profile": ctx.profile.name, "output_root": ctx.root,
        "stages": [s.summary_row() for s in stages],
        "inputs": inputs, "accepted": accepted, "rejected": rejected, "total_rejected": total_rejected,
        "balanced": accepted + total_rejected == inputs, "artifacts": artifacts,
    }


def balance_mark(balanced: bool | None) -> str:
    """A stage's balance check as shown: checked and true, or not a one-row-per-input stage."""
    return "checked" if balanced else ("FAILED" if balanced is False else "–")


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['flow']} ({summary['profile']})", "",
             f"Inputs **{summary['inputs']}**, accepted **{summary['accepted']}**, "
             f"rejected **{summary['total_rejected']}**, balanced: **{summary['balanced']}**", "",
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

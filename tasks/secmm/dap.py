"""The dap stage: Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1) over ``rde.secmm.dap``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from models.backends.registry import BUNDLED_LLM, spec_lineage
from models.backends.slot_layout import slot_layout
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde.common.text_diversity import diversity_by_domain, diversity_line
from rde.secmm import dap
from rde.secmm.dap_prompts import dap_prompt
from storage.schemas import (
    QUERIES,
    REJECTS,
)
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class DapPrompts:
    """What ``lineage`` loaded: the query generator, each domain's DAP prompt and the safety prompt."""

    generator: ModelSpec
    prompts: dict[str, Any]
    safety: Any


class Dap(Stage):
    """Distribution-Aware Prompting per domain: sampled keywords → generated queries, checked
    (rde/secmm/dap.py) until ``queries.per_domain`` are kept."""

    name = "dap"
    # 5: a combination needs grammar_min_pair_count captions; 6: actions, diversity stats; 7: garbled lines;
    # 8: a domain with no caption asks for no query
    version = "8"
    reads = ("caption_stats", "caption_pool")
    writes = (Write("queries", "queries", QUERIES), Write("query_rejects", "rejects", REJECTS, rejects=True))
    config = ("queries", "domains")
    resources = Resources(device="gpu", hold_slot=False)  # the query generator and the text encoder
    prepares = DapPrompts
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        gen_spec = run.models.query_generator or ModelSpec(**BUNDLED_LLM)
        prompts = {d.name: dap_prompt(d) for d in run.domains}
        safety = load_prompt("query_safety")
        run.prepared = DapPrompts(gen_spec, prompts, safety)
        return Lineage(models={"generator": run.registry().lineage(gen_spec),
                               "encoder": spec_lineage(run.models.text_encoder)},
                       prompts={**{f"dap_{k}": v.identity for k, v in prompts.items()},
                                "query_safety": safety.identity})

    def run(self, run: StageRun) -> Work:
        prepared: DapPrompts = run.prepared
        registry = run.registry()
        generator = registry.generator(prepared.generator)
        encoder = registry.text_encoder()
        layout = slot_layout(run.domains)  # the near-duplicate rule's attribute slots
        made = dap.every_domain_queries(prepared.prompts, run.input("caption_stats").to_pandas(),
                                        run.input("caption_pool").rows(["domain", "text"]), generator, encoder,
                                        run.section("queries"), prepared.safety.extras["blocked"], layout)
        queries, rejects = made.queries, made.rejects
        mean_keywords = sum(len(q["keywords"]) for q in queries) / len(queries) if queries else 0.0
        return Work.one({"queries": pa.Table.from_pylist(queries, schema=QUERIES),
                         "query_rejects": pa.Table.from_pylist(rejects, schema=REJECTS)},
                        {"input_rows": made.lines_in, "accepted": len(queries),
                         "rejected": dict(Counter(r["reason"] for r in rejects)),
                         "mean_keywords_per_query": round(mean_keywords, 3), "requests": made.requests,
                         "domains_without_captions": made.uncaptioned,
                         "diversity": diversity_by_domain(queries, layout)})

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(tables=[("dap-diversity", stats.get("diversity") or [{"domain": "-"}],
                               "DAP: how varied the kept queries are, per domain (distinct-n, facets, length)")],
                      log=f"dap: {result.accepted} queries kept of {result.input_rows} generated lines, "
                          f"{stats.get('mean_keywords_per_query')} sampled keywords per kept query; "
                          + diversity_line(stats.get("diversity") or [])
                          + "".join(f"; {d}: no caption, no query asked for"
                                    for d in stats.get("domains_without_captions", [])))

"""Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1, Table 11): caption-pool statistics →
keyword-filled prompts → an LLM writes queries → post-processing keeps the good ones.

This module holds the rounds: the keywords sampled for a request, the request itself, and a
domain's rounds until its quota of kept queries (``domain_queries``, the dap stage's work). The
two parts the rounds use live beside it, each readable on its own: the post-processing rules
(``rde.secmm.dap_postprocess``: which lines are kept, and why the others are rejected) and the
grammar of constrained decoding (``rde.secmm.dap_grammar``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.backends.interfaces import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    Generator,
    TextEncoder,
    parallel_requests,
)
from models.backends.slot_layout import SlotLayout
from models.prompt_files import PromptFile
from rde.common import caption_stats
from rde.common.caption_stats import NounUse
from rde.common.reasons import Reason, rejected_row
from rde.secmm.config import QueriesSpec
from rde.secmm.dap_grammar import build_grammar
from rde.secmm.dap_postprocess import LineContext, output_examples, postprocess_queries, split_queries


def sample_keywords(freqs: Counter[str], n: int, rng: np.random.Generator, pool: int = 200) -> list[str]:
    """``n`` distinct words drawn from the ``pool`` most frequent, with probability ∝ frequency
    (the statistics shape the prompt, sampling keeps prompts diverse)."""
    common = freqs.most_common(pool)
    if not common:
        return []
    words = [w for w, _ in common]
    weights = np.array([c for _, c in common], dtype=np.float64)
    picked = rng.choice(len(words), size=min(n, len(words)), replace=False, p=weights / weights.sum())
    return [words[i] for i in picked]


def sample_request_keywords(stats: dict[str, Counter[str]], spec: QueriesSpec,
                            rng: np.random.Generator) -> dict[str, list[str]]:
    """The keywords of one request per part of speech (``noun``, ``verb``, ``adj``)."""
    n = spec.keywords_per_pos
    return {pos: sample_keywords(stats.get(pos, Counter()), n, rng) for pos in ("noun", "verb", "adj")}


def dap_request(prompt: PromptFile, keywords: dict[str, list[str]], spec: QueriesSpec, request_id: str,
                seed: int, grammar: str | None = None) -> GenerationRequest:
    """One generation request: the system prompt and the keyword-filled user prompt of Table 11
    (``grammar``: an optional GBNF constraint that backends able to honour it apply)."""
    user = prompt.render("user", n=spec.per_request, nouns=", ".join(keywords.get("noun", [])),
                         verbs=", ".join(keywords.get("verb", [])), adjectives=", ".join(keywords.get("adj", [])))
    return GenerationRequest(request_id, [ChatMessage("system", prompt.templates["system"]),
                                          ChatMessage("user", user)],
                             max_tokens=spec.max_tokens, temperature=spec.temperature, seed=seed, grammar=grammar)


@dataclass
class DomainQueries:
    """One domain's DAP outcome: kept query rows, rejected line rows, the requests sent (with
    their sampled keywords) and the lines read back (the stage's input: each line returned and each
    failed request)."""

    queries: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lines_in: int = 0
    uncaptioned: list[str] = field(default_factory=list)


def generate_rounds(generator: Generator, prompt: PromptFile, stats: dict[str, Counter], uses: dict[str, NounUse],
                    domain_words: set[str], spec: QueriesSpec, rng: np.random.Generator, domain: str,
                    first: int) -> list[tuple[str, dict[str, Any], str | None, GenerationResult]]:
    """Rounds ``first``, ``first + 1``, ... generated in one call, as many as the generator answers
    at once (``parallel_requests``; 1 for most). A round's request depends only on the keyword
    draw, never on earlier rounds' answers, and the draws are made in round order, so the requests
    are those one-at-a-time generation sends; rounds generated beyond the quota are never read
    (they cost compute, not wall time)."""
    count = max(1, min(parallel_requests(generator), spec.max_rounds - first))
    made = []
    for round_ in range(first, first + count):
        rid = f"{domain}-r{round_:03d}"
        keywords = sample_request_keywords(stats, spec, rng)
        grammar = build_grammar(prompt, keywords, uses, domain_words, spec) if spec.constrained_decoding else None
        made.append((rid, keywords, grammar,
                     dap_request(prompt, keywords, spec, rid, seed=spec.seed * 1000 + round_, grammar=grammar)))
    answers = generator.generate([request for *_, request in made])
    return [(rid, keywords, grammar, res) for (rid, keywords, grammar, _), res in zip(made, answers, strict=True)]


def domain_queries(domain: str, prompt: PromptFile, stats: dict[str, Counter], texts: list[str],
                   generator: Generator, encoder: TextEncoder, spec: QueriesSpec, blocked: list[str],
                   layout: SlotLayout | None = None) -> DomainQueries:
    """Distribution-Aware Prompting for one domain: up to ``spec.max_rounds`` requests, each with
    keywords sampled from the caption-pool ``stats`` (and a GBNF grammar of pool phrases when
    ``constrained_decoding``), until ``spec.per_domain`` lines pass the post-processing. A valid
    line beyond the quota is rejected as ``over_target``."""
    out = DomainQueries()
    domain_words = set(prompt.extras.get("domain_words", []))
    examples = output_examples(prompt)
    vocab = (caption_stats.vocabulary(texts) | set(prompt.extras.get("vocabulary_allowed", []))
             if spec.vocabulary_check else None)
    uses = caption_stats.noun_uses(texts) if spec.constrained_decoding else {}
    line_ctx = LineContext(examples, encoder.encode(examples) if examples else None, vocab, layout=layout)
    rng = np.random.default_rng([spec.seed, len(domain)])
    accepted: list[str] = []
    ahead: list[tuple[str, dict[str, Any], str | None, GenerationResult]] = []  # rounds generated, not yet read
    for round_ in range(spec.max_rounds):
        if len(accepted) >= spec.per_domain:
            break
        if not ahead:
            ahead = generate_rounds(generator, prompt, stats, uses, domain_words, spec, rng, domain, round_)
        rid, keywords, grammar, res = ahead.pop(0)
        if spec.keyword_check:
            line_ctx.keywords[rid] = keywords
        out.requests.append({"request": rid, "domain": domain, **keywords, "grammar": grammar is not None})
        if not res.ok:
            out.lines_in += 1
            out.rejects.append(rejected_row(rid, "dap", Reason.GENERATION_FAILED, kind="query", domain=domain,
                                            detail=res.error))
            continue
        lines = split_queries(res.text)
        out.lines_in += len(lines)
        for v in postprocess_queries([(t, rid) for t in lines], domain_words, spec, blocked, encoder, accepted,
                                     line_ctx):
            if v.reason is None and len(accepted) < spec.per_domain:
                accepted.append(v.text)
                out.queries.append({"query_id": f"{domain}-q{len(accepted):04d}", "domain": domain, "text": v.text,
                                    "source": v.source, "generator": generator.model_id, "prompt": prompt.identity,
                                    "keywords": v.keywords})
            else:
                out.rejects.append(rejected_row(v.source, "dap", v.reason or Reason.OVER_TARGET, kind="query",
                                                domain=domain, text=v.text, detail=v.detail))
    return out


def every_domain_queries(prompts: dict[str, PromptFile], stats_rows: Any, caption_rows: list[dict[str, Any]],
                         generator: Generator, encoder: TextEncoder, spec: QueriesSpec, blocked: list[str],
                         layout: SlotLayout | None = None) -> DomainQueries:
    """``domain_queries`` for each domain with a prompt, in order, gathered into one outcome.
    ``stats_rows``: the caption-stats table (domain, pos, word, count); ``caption_rows``: the
    caption pool's (domain, text) rows. A domain with no caption has nothing to be
    distribution-aware of: no query is asked for it and it is listed in ``uncaptioned``."""
    out = DomainQueries()
    for domain, prompt in prompts.items():
        mine = stats_rows[stats_rows.domain == domain]
        stats = {pos: Counter(dict(zip(g.word, g["count"], strict=True))) for pos, g in mine.groupby("pos")}
        texts = [r["text"] for r in caption_rows if r["domain"] == domain]
        if not texts:
            out.uncaptioned.append(domain)
            continue
        made = domain_queries(domain, prompt, stats, texts, generator, encoder, spec, blocked, layout)
        out.queries += made.queries
        out.rejects += made.rejects
        out.requests += made.requests
        out.lines_in += made.lines_in
    return out

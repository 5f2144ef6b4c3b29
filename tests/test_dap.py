"""DAP: keyword sampling, prompt filling (Table 11) and the query post-processing rules."""

from __future__ import annotations

from collections import Counter

import numpy as np

from rde.dap import dap_request, postprocess_queries, sample_keywords, split_queries
from rde.profiles import QueriesSpec
from rde.prompt_files import load_prompt

SPEC = QueriesSpec(min_words=5, max_words=15, per_request=7, keywords_per_pos=3, near_duplicate_cosine=0.9)
DOMAIN = {"man", "woman", "person"}
BLOCKED = load_prompt("query_safety").extras["blocked"]


class BagOfWords:
    """A tiny deterministic text encoder: normalised word-count vectors."""

    dim = 64
    model_id = "bow"

    def encode(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().replace(".", "").split():
                out[i, hash(w) % self.dim] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_split_queries_strips_bullets_numbers_and_quotes() -> None:
    text = '1. A man walks.\n- "A woman runs."\n\n  • A person waits  \n2) Another man sits.'
    assert split_queries(text) == ["A man walks.", "A woman runs.", "A person waits", "Another man sits."]


def test_postprocess_rules_in_order() -> None:
    cands = [
        ("A man in a red jacket walks past the gate.", "r0"),
        ("A man in a red jacket walks past the gate!", "r0"),  # same words → duplicate
        ("a man in a red jacket walks past a gate", "r1"),  # near duplicate by embedding
        ("Man walks.", "r1"),
        ("A woman " + "very " * 15 + "tall.", "r1"),
        ("Here is a man walking with a large dog today.", "r2"),
        ("What is the man in the blue coat doing now?", "r2"),
        ("I am going to find a man in a blue coat.", "r2"),
        ("A man man man man man man man man walks.", "r2"),
        ("A red car parked near the gate of the building.", "r3"),
        ("A man with a gun running across the parking lot.", "r3"),
        ("A woman carrying a white bag crosses the street slowly.", "r3"),
        ("", "r3"),
    ]
    verdicts = postprocess_queries(cands, DOMAIN, SPEC, BLOCKED, BagOfWords())
    assert [v.reason for v in verdicts] == [None, "duplicate", "near_duplicate", "too_short", "too_long",
                                            "not_a_query", "not_a_query", "not_a_query", "degenerate",
                                            "off_domain", "unsafe", None, "empty"]
    assert verdicts[2].detail.startswith("cosine")


def test_accepted_before_counts_for_duplicates() -> None:
    v = postprocess_queries([("A man in a red jacket walks past the gate.", "r9")], DOMAIN, SPEC, BLOCKED, None,
                            accepted_before=["a man in a red jacket walks past the gate"])
    assert v[0].reason == "duplicate"


def test_keywords_follow_the_statistics_and_fill_the_table11_prompt() -> None:
    stats = {"noun": Counter({"jacket": 50, "bag": 30, "umbrella": 1, "hat": 1}), "verb": Counter({"walk": 5}),
             "adj": Counter({"red": 9, "black": 8})}
    rng = np.random.default_rng(0)
    picks = Counter(w for _ in range(300) for w in sample_keywords(stats["noun"], 1, rng))
    assert picks["jacket"] > picks["bag"] > picks["umbrella"]
    req = dap_request(load_prompt("dap_pedestrian"), stats, SPEC, np.random.default_rng(1), "q0", seed=3)
    system, user = req.messages
    assert "[Template Structure]" in system.content and "Safety Guardrails" in system.content
    assert "generate 7 pedestrian-related descriptions" in user.content
    assert "Verbs: walk" in user.content and req.seed == 3 and req.temperature == SPEC.temperature


def test_generation_failures_map_to_reason_codes() -> None:
    from rde.generation_retries import error_reason as generation_reason

    assert generation_reason("ungrounded: every sentence ...") == "ungrounded"
    assert generation_reason("refused: content_filter") == "refused"
    assert generation_reason("timeout after 60s (gave up after 4 attempts)") == "timeout"
    assert generation_reason("generation failed: RuntimeError: x") == "generation_failed"
    assert generation_reason(None) == "generation_failed"

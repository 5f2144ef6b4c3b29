"""Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1, Table 11): caption-pool statistics →
keyword-filled prompts → an LLM writes queries → post-processing keeps the good ones.

Post-processing rules, each a rejection reason: ``empty``, ``too_short`` / ``too_long`` (words
outside [min, max]), ``not_a_query`` (a question, a label such as "Query:", meta talk such as
"Here is", or first-person speech: a search query describes a scene), ``degenerate`` (fewer than
60 % distinct words: a repetition loop), ``off_domain`` (no domain word), ``unsafe`` (safety word list),
``duplicate`` (same normalised text), ``near_duplicate`` (text-embedding cosine ≥ threshold
with an earlier accepted query).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, TextEncoder
from rde.profiles import QueriesSpec
from rde.prompt_files import PromptFile

_BULLET = re.compile(r"^\s*(?:[-*•·]+|\d+[.)]|\(?\d+\)|[a-z][.)])\s*", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z]+(?:['-][A-Za-z]+)*")
_META = re.compile(r"^(here (is|are)|sure|okay|ok|note|query|queries|description|output|answer)\b", re.IGNORECASE)
_FIRST_PERSON = {"i", "i'm", "i've", "i'll", "me", "my", "we", "we're", "our", "us", "you", "your"}


def not_a_query(text: str) -> bool:
    """A question, a 'Label:' line, meta talk or first/second-person speech."""
    words = {w.lower() for w in _WORD.findall(text)}
    return "?" in text or ":" in text or bool(_META.match(text.strip())) or bool(words & _FIRST_PERSON)


def degenerate(text: str, min_distinct: float = 0.6) -> bool:
    words = [w.lower() for w in _WORD.findall(text)]
    return len(words) >= 6 and len(set(words)) / len(words) < min_distinct


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


def dap_request(prompt: PromptFile, stats: dict[str, Counter[str]], spec: QueriesSpec, rng: np.random.Generator,
                request_id: str, seed: int) -> GenerationRequest:
    """One generation request: the system prompt and the keyword-filled user prompt of Table 11."""
    n = spec.keywords_per_pos
    user = prompt.render("user", n=spec.per_request,
                         nouns=", ".join(sample_keywords(stats.get("noun", Counter()), n, rng)),
                         verbs=", ".join(sample_keywords(stats.get("verb", Counter()), n, rng)),
                         adjectives=", ".join(sample_keywords(stats.get("adj", Counter()), n, rng)))
    return GenerationRequest(request_id, [ChatMessage("system", prompt.templates["system"]),
                                          ChatMessage("user", user)],
                             max_tokens=spec.max_tokens, temperature=spec.temperature, seed=seed)


def split_queries(text: str) -> list[str]:
    """One query per line; bullets, numbering and wrapping quotes removed."""
    out = []
    for line in text.splitlines():
        line = _BULLET.sub("", line).strip().strip('"“”\'').strip()
        if line:
            out.append(line)
    return out


def normalise(text: str) -> str:
    return " ".join(w.lower() for w in _WORD.findall(text))


def is_unsafe(text: str, blocked: list[str]) -> bool:
    words = [w.lower() for w in _WORD.findall(text)]
    for term in blocked:
        if term.endswith("*"):
            if any(w.startswith(term[:-1]) for w in words):
                return True
        elif term in words:
            return True
    return False


@dataclass
class QueryVerdict:
    text: str
    source: str  # request id the query came from
    reason: str | None  # None = accepted
    detail: str | None = None


def postprocess_queries(candidates: list[tuple[str, str]], domain_words: set[str], spec: QueriesSpec,
                        blocked: list[str], encoder: TextEncoder | None,
                        accepted_before: list[str] | None = None) -> list[QueryVerdict]:
    """Apply the rules in order to (text, source) pairs; earlier accepted queries win ties."""
    verdicts: list[QueryVerdict] = []
    kept_norm = {normalise(t) for t in accepted_before or []}
    kept_texts = list(accepted_before or [])
    kept_vecs = encoder.encode(kept_texts) if encoder is not None and kept_texts else None
    cand_vecs = encoder.encode([t for t, _ in candidates]) if encoder is not None and candidates else None
    for i, (text, source) in enumerate(candidates):
        words = _WORD.findall(text)
        reason, detail = None, None
        if not words:
            reason = "empty"
        elif len(words) < spec.min_words:
            reason, detail = "too_short", f"{len(words)} words < {spec.min_words}"
        elif len(words) > spec.max_words:
            reason, detail = "too_long", f"{len(words)} words > {spec.max_words}"
        elif not_a_query(text):
            reason = "not_a_query"
        elif degenerate(text):
            reason = "degenerate"
        elif not {w.lower() for w in words} & domain_words:
            reason = "off_domain"
        elif is_unsafe(text, blocked):
            reason = "unsafe"
        elif normalise(text) in kept_norm:
            reason = "duplicate"
        elif cand_vecs is not None:
            vec = cand_vecs[i : i + 1]
            if kept_vecs is not None and len(kept_vecs):
                sims = kept_vecs @ vec[0]
                j = int(np.argmax(sims))
                if sims[j] >= spec.near_duplicate_cosine:
                    reason, detail = "near_duplicate", f"cosine {sims[j]:.3f} with {kept_texts[j]!r}"
            if reason is None:
                kept_vecs = vec if kept_vecs is None else np.vstack([kept_vecs, vec])
        if reason is None:
            kept_norm.add(normalise(text))
            kept_texts.append(text)
        verdicts.append(QueryVerdict(text, source, reason, detail))
    return verdicts

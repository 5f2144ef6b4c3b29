"""DAP post-processing (DSMM-TBIR Sec. 3.1): which of the lines an LLM wrote are kept as queries.

Split from ``rde.secmm.dap`` (the rounds) so the rules can be read and tested on their own; the
rounds call ``split_queries`` and ``postprocess_queries`` on every answer.

Post-processing rules, each a rejection reason: ``empty``, ``garbled`` (control or replacement
characters, ``rde.common.garbled_text``), ``too_short`` / ``too_long`` (words
outside [min, max]), ``not_a_query`` (a question, a label such as "Query:", meta talk such as
"Here is", or first-person speech: a search query describes a scene), ``degenerate`` (fewer than
60 % distinct words: a repetition loop), ``off_domain`` (no domain word), ``unsafe`` (safety word list),
``duplicate`` (same normalised text), ``near_duplicate`` (text-embedding cosine ≥ threshold
with an earlier accepted query that states the same attribute values, ``stated_attributes``).

Distribution checks (on when the stage passes a ``LineContext``): ``echoes_example`` (an exact or
near copy of a line of the prompt's own ``[Output Examples]``: same normalised text, cosine ≥ the
duplicate threshold, at most ``echo_max_word_edits`` words changed, or a copied span with
``echo_span_content_words`` content words; the example in ``detail``), ``off_vocabulary`` (a
content word that never occurs in the domain's caption pool and is not in the prompt file's
``vocabulary_allowed``; the words in ``detail``), ``no_keyword`` (uses none of the nouns/adjectives
sampled into its own request). Kept lines carry the sampled keywords they use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from models.backends.attributes import parse_text_attributes
from models.backends.interfaces import TextEncoder
from models.backends.slot_layout import SlotLayout
from models.prompt_files import PromptFile
from rde.common.garbled_text import garbled_detail
from rde.secmm.config import QueriesSpec

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


def output_examples(prompt: PromptFile) -> list[str]:
    """The lines under ``[Output Examples]`` in the system template: what a model may echo."""
    system = prompt.templates.get("system", "")
    if "[Output Examples]" not in system:
        return []
    block = system.split("[Output Examples]", 1)[1]
    lines = []
    for line in block.splitlines():
        if line.strip().startswith("["):  # the next section
            break
        if line.strip():
            lines.append(line.strip())
    return lines


def word_edits(a: list[str], b: list[str]) -> int:
    """Word-level edit distance (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, wa in enumerate(a, 1):
        cur = [i]
        for j, wb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (wa != wb)))
        prev = cur
    return prev[-1]


def _copied_span(a: list[str], b: list[str], content: set[str], need: int) -> str | None:
    """The longest run of words ``a`` shares with ``b`` if it holds ≥ ``need`` content words."""
    best: list[str] = []
    for i in range(len(a)):
        for j in range(len(b)):
            k = 0
            while i + k < len(a) and j + k < len(b) and a[i + k] == b[j + k]:
                k += 1
            if k > len(best):
                best = a[i : i + k]
    return " ".join(best) if sum(w in content for w in best) >= need else None


CONTENT_POS = frozenset({"NOUN", "PROPN", "ADJ", "VERB", "ADV", "NUM"})
Lemmatised = tuple[list[tuple[str, str]], set[str]]  # content (word, lemma) pairs; every word form and lemma


@dataclass
class LineContext:
    """What the distribution checks need: the prompt's examples (texts and vectors), the domain's
    caption-pool vocabulary plus allowed words (None: no vocabulary check), the sampled keywords
    per request id (no entry: no keyword check), and the lemmatiser (spaCy by default)."""

    examples: list[str] = field(default_factory=list)
    example_vecs: np.ndarray | None = None
    vocabulary: set[str] | None = None
    keywords: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    lemmatise: Callable[[list[str]], list[Lemmatised]] | None = None
    layout: SlotLayout | None = None  # the profile's domains' slots: the near-duplicate rule's attributes


def spacy_lemmas(texts: list[str]) -> list[Lemmatised]:
    """Per text: its content words (nouns, adjectives, verbs, adverbs, numbers) as (word, lemma),
    and the set of all its word forms and lemmas (for keyword matching)."""
    from rde.common.caption_stats import load_tagger

    out = []
    for doc in load_tagger().pipe(texts, batch_size=64):
        words = [t for t in doc if t.is_alpha]
        out.append(([(t.lower_, t.lemma_.lower()) for t in words if t.pos_ in CONTENT_POS],
                    {t.lower_ for t in words} | {t.lemma_.lower() for t in words}))
    return out


def off_vocabulary_words(content: list[tuple[str, str]], vocabulary: set[str]) -> list[str]:
    """Content words whose form and lemma are both outside ``vocabulary``."""
    bad: list[str] = []
    for word, lemma in content:
        if word not in vocabulary and lemma not in vocabulary and word not in bad:
            bad.append(word)
    return bad


def used_keywords(forms: set[str], keywords: dict[str, list[str]], kinds: tuple[str, ...] = ("noun", "verb", "adj")
                  ) -> list[str]:
    """The sampled keywords (of the given parts of speech) a line uses, by word form or lemma."""
    return [k for pos in kinds for k in keywords.get(pos, []) if k in forms]


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
    keywords: list[str] = field(default_factory=list)  # sampled keywords of its request the line uses


def echo_of(text: str, vec: np.ndarray | None, ctx: LineContext, spec: QueriesSpec,
            content_words: set[str]) -> str | None:
    """How ``text`` copies one of the prompt's output examples (``detail``), or None."""
    words = normalise(text).split()
    for k, example in enumerate(ctx.examples):
        ex_words = normalise(example).split()
        if words == ex_words:
            return f"same text as example {example!r}"
        if vec is not None and ctx.example_vecs is not None:
            cos = float(ctx.example_vecs[k] @ vec)
            if cos >= spec.near_duplicate_cosine:
                return f"cosine {cos:.3f} with example {example!r}"
        edits = word_edits(words, ex_words)
        if edits <= spec.echo_max_word_edits:
            return f"{edits} word(s) changed from example {example!r}"
        span = _copied_span(words, ex_words, content_words, spec.echo_span_content_words)
        if span:
            return f"copies {span!r} from example {example!r}"
    return None


def stated_attributes(text: str, layout: SlotLayout | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The attribute values a query states in ``layout``'s slots (colour per region, carried
    objects, types, motion: ``parse_text_attributes``), order-free; none without a layout. Two
    queries that state different values ask for different images however close their embeddings:
    MiniLM puts "A person wearing black bottoms and a red top." at cosine 0.924 to "A person
    wearing a black top and black bottoms."."""
    if layout is None:
        return ()
    attrs = parse_text_attributes(text, layout)
    return tuple((slot, tuple(sorted(attrs.top(slot)))) for slot in layout.text_slots if slot != "domain")


def postprocess_queries(candidates: list[tuple[str, str]], domain_words: set[str], spec: QueriesSpec,
                        blocked: list[str], encoder: TextEncoder | None,
                        accepted_before: list[str] | None = None,
                        context: LineContext | None = None) -> list[QueryVerdict]:
    """Apply the rules in order to (text, source) pairs; earlier accepted queries win ties."""
    ctx = context or LineContext()
    verdicts: list[QueryVerdict] = []
    kept_norm = {normalise(t) for t in accepted_before or []}
    kept_texts = list(accepted_before or [])
    kept_vecs = encoder.encode(kept_texts) if encoder is not None and kept_texts else None
    cand_vecs = encoder.encode([t for t, _ in candidates]) if encoder is not None and candidates else None
    needs_lemmas = ctx.vocabulary is not None or bool(ctx.keywords) or bool(ctx.examples)
    lemmatise = ctx.lemmatise or spacy_lemmas
    lemmas = lemmatise([t for t, _ in candidates]) if needs_lemmas and candidates else [([], set())] * len(candidates)
    example_content = set()
    if ctx.examples:
        for content, _ in lemmatise(ctx.examples):
            example_content |= {w for w, _ in content}
    for i, (text, source) in enumerate(candidates):
        words = _WORD.findall(text)
        content, forms = lemmas[i]
        sampled = ctx.keywords.get(source)
        used = used_keywords(forms, sampled) if sampled else []
        reason, detail = None, None
        if not words:
            reason = "empty"
        elif garbled := garbled_detail(text):
            reason, detail = "garbled", garbled
        elif len(words) < spec.min_words:
            reason, detail = "too_short", f"{len(words)} words < {spec.min_words}"
        elif len(words) > spec.max_words:
            reason, detail = "too_long", f"{len(words)} words > {spec.max_words}"
        elif not_a_query(text):
            reason = "not_a_query"
        elif degenerate(text):
            reason = "degenerate"
        elif ctx.examples and (echo := echo_of(text, cand_vecs[i] if cand_vecs is not None else None, ctx, spec,
                                               example_content)):
            reason, detail = "echoes_example", echo
        elif not {w.lower() for w in words} & domain_words:
            reason = "off_domain"
        elif is_unsafe(text, blocked):
            reason = "unsafe"
        elif ctx.vocabulary is not None and (bad := off_vocabulary_words(content, ctx.vocabulary | domain_words)):
            reason, detail = "off_vocabulary", "not in the domain's caption pool: " + ", ".join(bad)
        elif sampled is not None and (sampled.get("noun") or sampled.get("adj")) \
                and not used_keywords(forms, sampled, ("noun", "adj")):  # a request that sampled none checks none
            reason = "no_keyword"
            detail = "sampled nouns/adjectives: " + ", ".join(sampled.get("noun", []) + sampled.get("adj", []))
        elif normalise(text) in kept_norm:
            reason = "duplicate"
        elif cand_vecs is not None:
            vec = cand_vecs[i : i + 1]
            if kept_vecs is not None and len(kept_vecs):
                sims = kept_vecs @ vec[0]
                close = [j for j in np.argsort(-sims) if sims[j] >= spec.near_duplicate_cosine]
                if spec.near_duplicate_attributes:
                    mine = stated_attributes(text, ctx.layout)
                    close = [j for j in close if stated_attributes(kept_texts[j], ctx.layout) == mine]
                if close:
                    j = int(close[0])
                    reason, detail = "near_duplicate", f"cosine {sims[j]:.3f} with {kept_texts[j]!r}"
            if reason is None:
                kept_vecs = vec if kept_vecs is None else np.vstack([kept_vecs, vec])
        if reason is None:
            kept_norm.add(normalise(text))
            kept_texts.append(text)
        verdicts.append(QueryVerdict(text, source, reason, detail, used))
    return verdicts

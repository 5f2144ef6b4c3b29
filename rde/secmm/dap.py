"""Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1, Table 11): caption-pool statistics →
keyword-filled prompts → an LLM writes queries → post-processing keeps the good ones.

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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from models.backends.attributes import parse_text_attributes
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
from rde.common.garbled_text import garbled_detail
from rde.common.profiles import QueriesSpec
from rde.common.reasons import Reason, rejected_row

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


# -- grammar-constrained generation (queries.constrained_decoding) --------------------------------

def _gbnf(text: str) -> str:
    """A GBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _adjective_runs(adjectives: list[str]) -> list[str]:
    """Each adjective alone, then each ordered pair as "x and y"."""
    return adjectives + [f"{a} and {b}" for a in adjectives for b in adjectives if a != b]


def _alternatives(options: list[str]) -> str:
    return " | ".join(_gbnf(o) for o in dict.fromkeys(options))


def noun_phrases(lemma: str, use: NounUse, adjectives: list[str], article: bool = True) -> list[str]:
    """Noun phrases for one pool noun as the pool writes it: its usual form (plural stays plural),
    optionally one of ``adjectives``, with "a"/"an" for singular nouns when ``article``."""
    form = use.forms.most_common(1)[0][0] if use.forms else lemma
    plural = use.plural.most_common(1)[0][0] if use.plural else False
    phrases = [f"{adj} {form}" for adj in adjectives] + [form]
    if article and not plural:
        definite = use.definite * 2 > use.forms.total()  # "approaching the camera", not "a camera"
        phrases = [f"the {p}" if definite else f"{_article(p)} {p}" for p in phrases]
    return phrases


def keyword_slots(nouns: list[str], adjs: list[str], uses: dict[str, NounUse], skip: set[str],
                  min_count: int = 1) -> list[tuple[str, str]]:
    """(noun, adjective) pairs the caption pool attests, sampled adjectives first: line k of a
    request starts with pair k (cycled), so the lines use most of the keywords, as the prompt asks.
    Nouns the pool uses with a participle fewer than ``min_count`` times are not the domain's."""
    framed = [n for n in nouns if n in uses and n not in skip and uses[n].frames.total() >= min_count]
    slots = [(n, a) for a in adjs for n in framed if a in uses[n].adjectives]
    for n in framed:
        if n not in {s for s, _ in slots}:  # the noun's most frequent adjective, or none ("carrying a backpack")
            slots.append((n, uses[n].adjectives.most_common(1)[0][0] if uses[n].adjectives else ""))
    return slots


def complements(noun: str, adj: str, uses: dict[str, NounUse], nouns: set[str], sampled_adjs: list[str],
                limit: int) -> list[tuple[str, str]]:
    """(noun, adjective) complements for a line about ``adj noun``: only pairs one pool caption
    states together with it (``NounUse.together``), about the request's other sampled ``nouns``,
    sampled adjectives first, then the most frequent; at most ``limit`` per noun. Checking each
    pair against the whole pool instead let "white bottoms and a red top" through, which no single
    person in the demo wears."""
    seen = [(n, a) for (own, n, a), _ in uses[noun].together.most_common() if own == adj and n in nouns]
    picked: list[tuple[str, str]] = []
    for n in dict.fromkeys(n for n, _ in seen):
        options = [a for m, a in seen if m == n]
        options = [a for a in sampled_adjs if a in options] + options
        picked += [(n, a) for a in list(dict.fromkeys(options))[:limit]]
    return picked


def attested_uses(uses: dict[str, NounUse], min_count: int) -> dict[str, NounUse]:
    """``uses`` keeping only what at least ``min_count`` pool captions say: an adjective on a noun,
    a combination of two (``together``), a noun as subject. A pair said once or twice is often a
    measurement slip (on the demo, "red bottoms" and "white bottoms" from a jacket's hem or the
    pavement): no person in the pool matches a query built on it."""
    kept: dict[str, NounUse] = {}
    for lemma, use in uses.items():  # a pool noun is no adjective: "a black top and black bottoms" is
        # tagged "top"/ADJ on "bottoms" by the small spaCy model, which gave "wearing top bottoms"
        adjectives = Counter({a: c for a, c in use.adjectives.items() if c >= min_count and a not in uses})
        together = Counter({(own, n, a): c for (own, n, a), c in use.together.items()
                            if c >= min_count and (not own or own in adjectives)
                            and (not a or uses.get(n, NounUse()).adjectives[a] >= min_count)})
        actions = Counter({(own, act): c for (own, act), c in use.actions.items()
                           if c >= min_count and (not own or own in adjectives)})
        kept[lemma] = replace(use, adjectives=adjectives, together=together, actions=actions,
                              subject=use.subject if use.subject >= min_count else 0)
    return kept


def build_grammar(prompt: PromptFile, keywords: dict[str, list[str]], uses: dict[str, NounUse],
                  domain_words: set[str], spec: QueriesSpec) -> str | None:
    """A GBNF grammar for one request: the prompt file's ``grammar`` template (the domain's
    template structure, "[subject] + [descriptor] + optional complement") filled with phrases the
    caption pool attests for the request's sampled keywords. ``{described_subjects}`` is each
    subject with the sampled adjectives the pool attests on that subject (``grammar_predicate``
    in the prompt file): "bus that is gray" only if pool captions call a bus gray. Every line it allows uses a sampled
    noun or adjective and only pool words plus the template's function words. A template whose
    ``line`` rule has ``{first}``/``{others}`` gets one line rule per query: ``{first}`` is the
    line's (noun, adjective) keyword slot, ``{others}`` a complement about another sampled noun
    that one pool caption states together with ``{first}`` (see ``complements``). A template's
    ``action_line`` rule replaces ``line`` for a slot the pool attests an action with (``{action}``:
    "walking to the left", said by at least ``grammar_min_pair_count`` captions that also say the
    slot's phrase); ``{acting_subjects}`` are subjects doing an attested action (``subject_actions``).
    None when the sampled keywords give no phrase (the request then runs unconstrained)."""
    template = prompt.extras.get("grammar")
    if not template:
        return None
    uses = attested_uses(uses, spec.grammar_min_pair_count)
    nouns, adjs = keywords.get("noun", []), keywords.get("adj", [])
    subjects = sorted((lem for lem in uses if lem in domain_words and uses[lem].subject),
                      key=lambda lem: -uses[lem].subject)
    if not subjects:
        return None
    limit = spec.grammar_phrases
    subject_words = [noun_phrases(s, uses[s], [], article=False)[0] for s in subjects]
    subject_phrases = [p for s in subjects if s in nouns or set(adjs) & set(uses[s].adjectives)
                       for p in noun_phrases(s, uses[s], [a for a in adjs if a in uses[s].adjectives][:limit])]
    subject_adjs = [a for a in adjs if any(a in uses[s].adjectives for s in subjects)][:limit]
    predicate = prompt.extras.get("grammar_predicate", "{subject} that is {adjectives}")
    described = [predicate.format(subject=word, adjectives=c) for s, word in zip(subjects, subject_words, strict=True)
                 for c in _adjective_runs([a for a in adjs if a in uses[s].adjectives][:limit])]
    acting = subject_actions(subjects, subject_words, uses, nouns, adjs,
                             prompt.extras.get("grammar_action_predicate", "{subject} that is {action}"), limit)
    fills = {"{subjects}": _alternatives(subject_words), "{subject_phrases}": _alternatives(subject_phrases),
             "{subject_adjectives}": _alternatives(_adjective_runs(subject_adjs)),
             "{described_subjects}": _alternatives(described),
             "{acting_subjects}": _alternatives(acting or described)}
    if any(name in template and not value for name, value in fills.items()):
        return None  # a slot the template needs has no phrase for these keywords
    for name, value in fills.items():
        template = template.replace(name, value)
    rules = template.splitlines()
    line_rule = next((r for r in rules if r.startswith("line ::=")), None)
    if line_rule is None or "{first}" not in line_rule:
        return template.replace("{lines}", " ".join(["line"] * spec.per_request))
    generic = set(prompt.extras.get("grammar_generic_nouns", []))  # "wearing a clothing" says nothing
    slots = keyword_slots(nouns, adjs, uses, domain_words | generic, spec.grammar_min_count)
    if not slots:
        return None
    lines = []
    action_rule = next((r for r in rules if r.startswith("action_line ::=")), None)
    rules = [r for r in rules if r != action_rule]
    for k in range(spec.per_request):
        noun, adj = slots[k % len(slots)]
        frames = [f for f, c in uses[noun].frames.most_common() if c >= spec.grammar_min_count] or \
            [uses[noun].frames.most_common(1)[0][0]]
        frame = frames[(k // len(slots)) % len(frames)]  # each wording the pool uses, in turn
        others = [phrase  # "wearing a black top and blue bottoms": the other noun under the same frame
                  for n, a in complements(noun, adj, uses, {n for n, _ in slots}, adjs, limit)
                  if uses[n].frames[frame] for phrase in noun_phrases(n, uses[n], [a] if a else [])[:1]]
        first = _alternatives([f"{frame} {p}" for p in noun_phrases(noun, uses[noun], [adj] if adj else [])[:1]])
        actions = [act for (own, act), _ in uses[noun].actions.most_common() if own == adj]
        actions = actions[k % len(actions):] + actions[:k % len(actions)] if actions else []
        verbs = keywords.get("verb", [])  # an action with a sampled verb first: "walking" for "walk"
        actions = sorted(actions, key=lambda act: not any(w.startswith(v) for v in verbs for w in act.split()))
        actions = actions[:limit]
        template = action_rule.replace("action_line ::=", "line ::=") if actions and action_rule else line_rule
        rule = template.replace("line ::=", f"line{k} ::=").replace("{first}", f"({first})")
        rule = rule.replace("{action}", f"({_alternatives(actions)})")
        if others:
            rule = rule.replace("{others}", f"({_alternatives(others)})")
        else:  # nothing else to add: drop the optional complement group
            rule = re.sub(r"\(\s*\" and \"\s*\{others\}\s*\)\?", "", rule)
        lines.append(rule)
    rules = [r for r in rules if r != line_rule] + lines
    return "\n".join(rules).replace("{lines}", " ".join(f"line{k}" for k in range(spec.per_request)))


def subject_actions(subjects: list[str], words: list[str], uses: dict[str, NounUse], nouns: list[str],
                    adjs: list[str], predicate: str, limit: int) -> list[str]:
    """Subjects doing what the pool says they do, as ``predicate`` phrases ("black car that is
    moving to the left"): each (adjective, action) a subject has in ``uses[...].actions`` (already
    thinned by ``attested_uses``), keeping those whose adjective was sampled, or any of a sampled
    subject noun; at most ``limit`` per subject."""
    phrases = []
    for lemma, word in zip(subjects, words, strict=True):
        found = [(own, act) for (own, act), _ in uses[lemma].actions.most_common()
                 if (own and own in adjs) or lemma in nouns]
        phrases += [predicate.format(subject=f"{own} {word}" if own else word, action=act)
                    for own, act in found[:limit]]
    return phrases


@dataclass
class DomainQueries:
    """One domain's DAP outcome: kept query rows, rejected line rows, the requests sent (with
    their sampled keywords) and the lines read back (the stage's input: each line returned and each
    failed request)."""

    queries: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lines_in: int = 0


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

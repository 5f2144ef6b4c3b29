"""Sentence and grounding checks for generated texts, from spaCy's parse and measured facts.

* ``fragment_reason``: is a sentence complete? A subject and a verb (or a caption-style noun
  phrase with a verb modifier, "A man walking down a street."), no dangling last word (a
  determiner, preposition, conjunction or auxiliary with nothing after it), no restart (the same
  word n-gram twice inside one sentence: "The person is wearing a black ... The person is wearing";
  a capitalised "The" in mid-sentence), no "a <colour>" without its noun ("a black with").
* ``ungrounded_words``: content words (nouns, adjectives, verbs, numbers) that are neither in the
  image's measured facts nor in the prompt file's generic words ("person", "wear"): "eyes",
  "auburn", "complexion" name attributes nothing measured.
* ``garbled``: a sentence with control or replacement characters (``rde.common.garbled_text``).
* ``clean_caption``: keep the complete, grounded sentences of a caption, each once; report the others.

Shared by the caption pool (DSMM-TBIR statistics) and usable by other caption gates; the words
that state no attribute are data (``prompts/caption_pool.yaml``), not code.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from models.backends.attributes import COLOUR_SYNONYMS
from models.fact_wording import fill_values, render_sentence
from rde.common.caption_stats import load_tagger
from rde.common.garbled_text import garbled_detail

CONTENT_POS = frozenset({"NOUN", "PROPN", "ADJ", "VERB", "NUM"})
# Parts of speech / dependencies that cannot end a complete sentence (they need a word after them).
DANGLING_POS = frozenset({"DET", "ADP", "CCONJ", "SCONJ", "AUX", "PART"})
DANGLING_DEP = frozenset({"det", "poss", "cc", "prep", "aux", "auxpass", "mark", "predet"})
DANGLING_TAG = frozenset({"DT", "PRP$", "CC", "IN", "TO", "MD"})  # "carrying a." ("a" parsed as a pronoun)
SUBJECT_DEP = frozenset({"nsubj", "nsubjpass", "expl", "csubj", "csubjpass"})
VERB_MODIFIER_DEP = frozenset({"acl", "relcl"})
OBJECT_DEP = frozenset({"dobj", "obj", "prep", "attr", "dative", "ccomp", "xcomp", "acomp", "oprd"})
_ONE_LETTER_STOP = re.compile(r"\b([A-Za-z])\.(\s|$)")  # "carrying a." -> "carrying a ." (spaCy keeps "a." whole)


@dataclass
class SentenceVerdict:
    """One sentence of a caption: kept (``reason`` None) or dropped with ``fragment`` /
    ``ungrounded_attribute`` and what was wrong in ``detail``."""

    text: str
    reason: str | None
    detail: str | None = None


@dataclass
class CaptionCheck:
    """A caption after the checks: the kept sentences joined, and every sentence's verdict."""

    kept: str
    sentences: list[SentenceVerdict] = field(default_factory=list)

    @property
    def dropped(self) -> list[SentenceVerdict]:
        return [s for s in self.sentences if s.reason is not None]

    @property
    def clean(self) -> bool:
        """Every sentence complete and grounded (nothing had to be dropped)."""
        return bool(self.sentences) and not self.dropped


def _prepare(text: str) -> str:
    return _ONE_LETTER_STOP.sub(r"\1 .\2", text.strip())


def fragment_reason(sent, restart_ngram: int = 3, needs_object: frozenset[str] = frozenset()) -> str | None:
    """Why a parsed sentence (a spaCy ``Span``) is not a complete sentence, or None. A root verb
    whose lemma is in ``needs_object`` ("wear", "carry") must have an object ("The person is wearing.")."""
    words = [t for t in sent if t.is_alpha]
    if not words:
        return "no words"
    lowered = [t.lower_ for t in words]
    grams = Counter(tuple(lowered[i : i + restart_ngram]) for i in range(len(lowered) - restart_ngram + 1))
    repeated = [g for g, c in grams.items() if c > 1]
    if repeated:
        return f"repeated restart {' '.join(repeated[0])!r}"
    for before, word in pairwise(words):
        if word.text in {"The", "A", "An"} and before.is_alpha:  # "a black The person": a restart
            return f"restart {word.text!r} in mid-sentence after {before.text!r}"
    for first, conj, second in zip(words, words[1:], words[2:], strict=False):
        if conj.lower_ in {"and", "or"} and first.lower_ == second.lower_:  # "a black and black clothing"
            return f"{first.text!r} coordinated with itself"
    for t, after in zip(words, [*words[1:], None], strict=True):
        if (t.pos_ == "ADJ" and t.dep_ == "conj" and t.head.pos_ == "NOUN"  # "a black top and dark-black"
                and (after is None or after.pos_ not in {"NOUN", "PROPN", "ADJ"})):  # not "and grey bottoms"
            return f"{t.text!r} joined to the noun {t.head.text!r} names nothing"
    for k, (det, colour, after) in enumerate(zip(words, words[1:], words[2:], strict=False)):
        if det.lower_ not in {"a", "an"} or colour.lower_ not in COLOUR_SYNONYMS:
            continue
        if after.lower_ in {"and", "or"}:  # "a black and white top", not "a black and a black"
            after = words[k + 3] if k + 3 < len(words) else after
            if after.lower_ in COLOUR_SYNONYMS or after.pos_ == "ADJ":
                continue
        if after.lower_ not in COLOUR_SYNONYMS and after.pos_ not in {"NOUN", "PROPN", "ADJ"}:
            return f"'a {colour.text}' with no noun after the colour ({after.text!r} follows)"
    if re.search(r"\w-\W*$", sent.text):  # "a black, high-."
        return "ends on a hyphen: a word cut off"
    last = words[-1]
    if last.pos_ in DANGLING_POS or last.dep_ in DANGLING_DEP or last.tag_ in DANGLING_TAG:
        return f"ends with {last.text!r} ({last.pos_.lower()}) and nothing after it"
    if last.lower_ in COLOUR_SYNONYMS and any(c.dep_ == "det" and c.lower_ in {"a", "an"} for c in last.children):
        return f"'a {last.text}' with no noun after the colour"
    root = sent.root
    children = {c.dep_ for c in root.children}
    if root.pos_ in {"VERB", "AUX"}:
        if not children & SUBJECT_DEP:
            return f"no subject for {root.text!r}"
        if root.lemma_.lower() in needs_object and not children & OBJECT_DEP:
            return f"{root.text!r} with nothing worn or carried"
        return None
    if root.pos_ in {"NOUN", "PROPN", "PRON"}:
        if any(t.dep_ in VERB_MODIFIER_DEP and t.pos_ in {"VERB", "AUX"} for t in sent):
            return None  # caption-style noun phrase with a verb: "A man walking down a street."
        return f"no verb (a noun phrase headed by {root.text!r})"
    return f"no verb (root {root.text!r} is {root.pos_.lower()})"


def ungrounded_words(sent, allowed: set[str], generic: set[str]) -> set[str]:
    """Content words of a parsed sentence that neither the facts (``allowed``) nor the generic words
    cover; colour synonyms count as the measured colour, intensity words ("light") as no claim."""
    allowed_colours = {COLOUR_SYNONYMS.get(a) for a in allowed} - {None}
    bad = set()
    for t in sent:
        if not t.is_alpha or t.pos_ not in CONTENT_POS:
            continue
        word, lemma = t.lower_, t.lemma_.lower()
        if {word, lemma} & (allowed | generic):
            continue
        if word in COLOUR_SYNONYMS and (COLOUR_SYNONYMS[word] is None or COLOUR_SYNONYMS[word] in allowed_colours):
            continue
        bad.add(word)
    return bad


def check_captions(texts: Iterable[str], allowed: Iterable[set[str] | None], generic: set[str],
                   restart_ngram: int = 3, nlp=None, needs_object: Iterable[str] = ()) -> list[CaptionCheck]:
    """``clean_caption`` for many captions in one spaCy pass; ``allowed`` None skips grounding
    (no measured facts, e.g. a human caption file). A sentence said again in the same caption is
    dropped as ``repeated_sentence`` (the first one stays)."""
    nlp = nlp or load_tagger()
    texts = list(texts)
    needs_object = frozenset(needs_object)
    out = []
    for doc, facts in zip(nlp.pipe([_prepare(t) for t in texts], batch_size=64), allowed, strict=True):
        verdicts = []
        said: set[str] = set()
        for sent in doc.sents:
            if garbled := garbled_detail(sent.text):
                verdicts.append(SentenceVerdict(sent.text, "garbled", garbled))
                continue
            if not any(t.is_alpha for t in sent):
                continue
            words = " ".join(t.lower_ for t in sent if t.is_alpha)
            if words in said:
                verdicts.append(SentenceVerdict(sent.text, "repeated_sentence", "said earlier in the caption"))
                continue
            said.add(words)
            frag = fragment_reason(sent, restart_ngram, needs_object)
            if frag:
                verdicts.append(SentenceVerdict(sent.text, "fragment", frag))
                continue
            bad = ungrounded_words(sent, facts, generic) if facts is not None else set()
            if bad:
                verdicts.append(SentenceVerdict(sent.text, "ungrounded_attribute",
                                                f"not measured: {', '.join(sorted(bad))}"))
            else:
                verdicts.append(SentenceVerdict(sent.text, None))
        kept = " ".join(v.text.strip() for v in verdicts if v.reason is None)
        kept = re.sub(r"\s+([.,;!?])", r"\1", kept)
        out.append(CaptionCheck(kept, verdicts))
    return out


def clean_caption(text: str, allowed: set[str] | None, generic: set[str], restart_ngram: int = 3,
                  nlp=None, needs_object: Iterable[str] = ()) -> CaptionCheck:
    """The complete, grounded sentences of ``text`` (see the module docstring)."""
    return check_captions([text], [allowed], generic, restart_ngram, nlp, needs_object)[0]


def facts_caption(values: dict[str, list[str]], templates: dict[str, Any],
                  phrases: dict[str, dict[str, str]] | None = None, derived: dict[str, str] | None = None,
                  seed_text: str = "") -> str:
    """A caption rendered from measured values with the prompt file's sentences; what was not
    measured is left out. Each entry is a sentence, a list of them (the first that renders is said:
    "The vehicle is a black car.", else "The vehicle is black."), or ``{"variants": [...]}``: one
    wording picked by ``seed_text`` (a stable hash, so an image keeps its wording across runs), the
    following ones tried when it does not render. ``{value}`` is the entry's own attribute,
    ``{<attribute>}`` any other, ``[...|...]`` an optional group (``render_sentence``); ``derived``
    names values said through another attribute's values (``heading`` from ``direction``)."""
    values = {**values, **{name: values[source] for name, source in (derived or {}).items() if values.get(source)}}
    sentences = []
    for attribute, options in templates.items():
        if isinstance(options, dict):
            variants = list(options["variants"])
            start = int(hashlib.sha256(f"{seed_text}|{attribute}".encode()).hexdigest(), 16) % len(variants)
            options = variants[start:] + variants[:start]
        for template in [options] if isinstance(options, str) else options:
            if "[" not in template and "{value}" in template:
                text = fill_values(template, values, phrases or {}, attribute)
            else:
                text = render_sentence(template.replace("{value}", "{" + attribute + "}"), values, phrases)
            if text:
                sentences.append(text)
                break
    return " ".join(sentences)

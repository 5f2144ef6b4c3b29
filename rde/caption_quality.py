"""Quality gates for generated captions (issue 5, stage 9): strip boilerplate, then reject by
format, length and repetition. A rejected text keeps its reason code and the text itself."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rde.qa_pairs import has_qa_markers

_SENTENCE = re.compile(r"[^.!?]+[.!?]?")
_WORDS = re.compile(r"[A-Za-z0-9]+(?:['-][A-Za-z0-9]+)*")


@dataclass(frozen=True)
class GateResult:
    text: str  # the cleaned text (boilerplate removed, whitespace normalised)
    reason: str | None  # None = accepted; else a reason code
    detail: str = ""


def word_count(text: str) -> int:
    return len(_WORDS.findall(text))


def strip_boilerplate(text: str, phrases: Sequence[str]) -> str:
    """Remove phrases such as "in the image" (case-insensitive, whole words) and tidy the spacing
    and punctuation left behind; a sentence that now starts lower-case is capitalised."""
    out = " ".join(text.split())
    for phrase in sorted(phrases, key=len, reverse=True):
        out = re.sub(rf"(?i)(?<![\w-]){re.escape(phrase)}(?![\w-])[,:]?", "", out)
    out = re.sub(r"\s+([,.;:!?])", r"\1", out)
    out = re.sub(r"\s{2,}", " ", out).strip(" ,;:")
    out = re.sub(r"(^|[.!?]\s+)([a-z])", lambda m: m.group(1) + m.group(2).upper(), out)
    return out


_CONTRAST = re.compile(r",?\s+(?:while|whereas|but|unlike)\s+|,\s+(?:just\s+)?like\s+", re.I)


def drop_negative_mentions(text: str, phrases: Sequence[str]) -> tuple[str, int]:
    """Remove what describes the hard-negative image (the revised sum-instruction of GTR+ Sec. 3.1.2
    asks for the target only): a contrast clause ("..., while the person in Compare-Image ...") is
    cut off; a sentence that mentions the negative in its main clause is dropped. Returns the text
    and how many pieces were removed."""
    lowered = [p.lower() for p in phrases]
    kept, removed = [], 0
    for sentence in _SENTENCE.findall(text):
        if not any(p in sentence.lower() for p in lowered):
            kept.append(sentence.strip())
            continue
        head = _CONTRAST.split(sentence, maxsplit=1)[0].strip()
        removed += 1
        if head != sentence.strip() and not any(p in head.lower() for p in lowered):
            kept.append(head.rstrip(",;") + ".")
    return " ".join(k for k in kept if k), removed


def repeated_sentence_share(text: str) -> float:
    """Share of sentences that repeat an earlier sentence (after normalisation)."""
    sentences = [" ".join(_WORDS.findall(s.lower())) for s in _SENTENCE.findall(text)]
    sentences = [s for s in sentences if s]
    if not sentences:
        return 0.0
    return 1.0 - len(set(sentences)) / len(sentences)


def gate_caption(text: str, *, min_words: int, max_words: int, boilerplate: Sequence[str],
                 max_repeated_sentence_share: float, negative_mentions: Sequence[str] = ()) -> GateResult:
    """Clean ``text`` (negative mentions, then boilerplate) and decide: ``malformed_output`` (still
    Q&A-shaped or an unfilled [slot]), ``too_short``, ``too_long`` or ``repetitive``; None passes."""
    if negative_mentions:
        text, _ = drop_negative_mentions(text, negative_mentions)
    clean = strip_boilerplate(text, boilerplate)
    if re.search(r"\[[a-z /]+\]", clean):
        return GateResult(clean, "malformed_output", "an unfilled template [slot] remains")
    if has_qa_markers(clean):
        return GateResult(clean, "malformed_output", "a description still contains Q:/A: pairs")
    words = word_count(clean)
    if words < min_words:
        return GateResult(clean, "too_short", f"{words} words < {min_words}")
    if words > max_words:
        return GateResult(clean, "too_long", f"{words} words > {max_words}")
    share = repeated_sentence_share(clean)
    if share > max_repeated_sentence_share:
        return GateResult(clean, "repetitive", f"{share:.0%} of sentences repeat an earlier one")
    return GateResult(clean, None)

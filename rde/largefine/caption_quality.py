"""Quality gates for generated captions: strip boilerplate and drop repeated
sentences, then reject by format, repetition and length. A rejected text keeps its
reason code and the text itself."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rde.common.garbled_text import garbled_detail
from rde.largefine.qa_pairs import has_qa_markers

_SENTENCE = re.compile(r"[^.!?]+[.!?]?")
_WORDS = re.compile(r"[A-Za-z0-9]+(?:['-][A-Za-z0-9]+)*")


@dataclass(frozen=True)
class GateResult:
    text: str  # the cleaned text (negative mentions, boilerplate and repeated sentences removed)
    reason: str | None  # None = accepted; else a reason code
    detail: str = ""
    cleaning: tuple[str, ...] = ()  # what was removed: "negative_mentions:N", "boilerplate", "repeated_sentences:N"


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


def _sentence_key(sentence: str) -> str:
    """A sentence compared by its words only (case and punctuation ignored)."""
    return " ".join(_WORDS.findall(sentence.lower()))


def repeated_sentence_share(text: str) -> float:
    """Share of sentences that repeat an earlier sentence (after normalisation)."""
    sentences = [k for k in (_sentence_key(s) for s in _SENTENCE.findall(text)) if k]
    if not sentences:
        return 0.0
    return 1.0 - len(set(sentences)) / len(sentences)


def drop_repeated_sentences(text: str) -> tuple[str, int]:
    """Keep the first occurrence of every sentence and drop its repeats (a repeat carries no
    information and skews the training text); returns the text and how many sentences were dropped."""
    seen: set[str] = set()
    pieces: list[str] = []  # the original text minus the repeats, so "1.5 m" or "..." survive as written
    position = dropped = 0
    for match in _SENTENCE.finditer(text):
        key = _sentence_key(match.group())
        if key and key in seen:
            pieces.append(text[position:match.start()])
            position = match.end()
            dropped += 1
        seen.add(key)
    pieces.append(text[position:])
    return (re.sub(r"\s{2,}", " ", "".join(pieces)).strip(), dropped) if dropped else (text, 0)


def repeated_run(text: str, n: int = 5) -> str | None:
    """A run of ``n`` words said twice inside one sentence (a generation loop without full stops:
    "The person is wearing a black top The person is wearing a black top ..."), or None."""
    for sentence in _SENTENCE.findall(text):
        words = re.findall(r"[a-z']+", sentence.lower())
        seen: set[tuple[str, ...]] = set()
        for i in range(len(words) - n + 1):
            run = tuple(words[i : i + n])
            if run in seen:
                return " ".join(run)
            seen.add(run)
    return None


def gate_caption(text: str, *, min_words: int, max_words: int, boilerplate: Sequence[str],
                 max_repeated_sentence_share: float, negative_mentions: Sequence[str] = (),
                 drop_repeats: bool = True) -> GateResult:
    """Clean ``text`` (negative mentions, boilerplate, then repeated sentences unless ``drop_repeats``
    is off) and decide: ``malformed_output`` (still Q&A-shaped or an unfilled [slot]), ``repetitive``
    (more than ``max_repeated_sentence_share`` of the sentences repeated an earlier one before the
    repeats were dropped, or five words said twice inside one sentence: ``repeated_run``),
    ``too_short`` or ``too_long`` (on the cleaned text), after ``garbled`` (control or replacement
    characters anywhere: not text at all); None passes."""
    if garbled := garbled_detail(text):
        return GateResult(text, "garbled", garbled, ())
    cleaning: list[str] = []
    if negative_mentions:
        text, removed = drop_negative_mentions(text, negative_mentions)
        if removed:
            cleaning.append(f"negative_mentions:{removed}")
    clean = strip_boilerplate(text, boilerplate)
    if clean != strip_boilerplate(text, ()):
        cleaning.append("boilerplate")
    share, before = repeated_sentence_share(clean), word_count(clean)
    dropped = 0
    if drop_repeats:
        clean, dropped = drop_repeated_sentences(clean)
        if dropped:
            cleaning.append(f"repeated_sentences:{dropped}")
    done = tuple(cleaning)
    note = f" (after cleaning: {', '.join(done)})" if done else ""
    if dropped:  # what the text was before the repeats went, so a rejected row explains itself
        note = f" (after cleaning: {', '.join(done)}; before dropping repeats {before} words, {share:.0%} repeated)"
    if re.search(r"\[[a-z /]+\]", clean):
        return GateResult(clean, "malformed_output", "an unfilled template [slot] remains", done)
    if has_qa_markers(clean):
        return GateResult(clean, "malformed_output", "a description still contains Q:/A: pairs", done)
    if share > max_repeated_sentence_share:
        return GateResult(clean, "repetitive", f"{share:.0%} of sentences repeat an earlier one{note}", done)
    if run := repeated_run(clean):
        return GateResult(clean, "repetitive", f"{run!r} twice in one sentence (a loop without full stops){note}",
                          done)
    words = word_count(clean)
    if words < min_words:
        return GateResult(clean, "too_short", f"{words} words < {min_words}{note}", done)
    if words > max_words:
        return GateResult(clean, "too_long", f"{words} words > {max_words}{note}", done)
    return GateResult(clean, None, "", done)

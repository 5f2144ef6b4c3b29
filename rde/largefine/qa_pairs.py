"""Question-and-answer pairs of the GTR+ base and intermediate tiers (paper Figs. 4-5).

The prompts ask for numbered ``Q1:``/``A1:`` lines. Parsing is lenient about layout (pairs on one
line, ``Question``/``Answer`` spelled out, numbering missing) and strict about content: a question
needs an answer, repeated pairs count once, and too few pairs make the output malformed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "Q1:", "A1.", "Q:", "Answer 2)", "**Q3:**": a marker word, an optional number, then : or ) (or . after a number).
_MARKER = re.compile(r"(?<!\w)(?:\*\*)?(Q|A|Question|Answer)\s*(?:\d+\s*[.:)]|[:)])(?:\*\*)?\s*", re.I)


@dataclass(frozen=True)
class QAPair:
    question: str
    answer: str


def parse_qa_pairs(text: str) -> list[QAPair]:
    """Distinct (question, answer) pairs in generator output, in order of first appearance.

    A question followed by another question (no answer) is dropped; an answer with no question
    before it is dropped; a pair whose normalised text was seen before is dropped.
    """
    markers = list(_MARKER.finditer(text))
    pairs: list[QAPair] = []
    seen: set[tuple[str, str]] = set()
    question: str | None = None
    for i, match in enumerate(markers):
        end = markers[i + 1].start() if i + 1 < len(markers) else len(text)
        body = " ".join(text[match.end():end].split()).strip()
        if match.group(1).upper().startswith("Q"):
            question = body or None
            continue
        if question and body:
            key = (_normal(question), _normal(body))
            if key not in seen:
                seen.add(key)
                pairs.append(QAPair(question, body))
        question = None
    return pairs


def format_qa_pairs(pairs: list[QAPair]) -> str:
    """The pairs as numbered lines, the form the sum-instructions quote."""
    return "\n".join(f"Q{i}: {p.question}\nA{i}: {p.answer}" for i, p in enumerate(pairs, 1))


def has_qa_markers(text: str) -> bool:
    """True if a text still contains Q:/A: markers (a summary that echoed the pairs)."""
    return bool(_MARKER.search(text))


def _normal(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))

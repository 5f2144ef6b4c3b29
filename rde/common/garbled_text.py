"""Is a generated text made of characters no caption or query holds?

A generator with random or broken weights, a wrong tokenizer or a decoding bug writes control
characters and U+FFFD (bytes that were not valid UTF-8). spaCy still parses such text into
"sentences" with a subject and a verb, so the sentence checks alone would keep it. Any such
character rejects the text as ``garbled``: a surveillance caption or query is plain text, and one
bad character already says that the generation went wrong.
"""

from __future__ import annotations

import unicodedata

BAD_CATEGORIES = {"Cc": "control", "Cs": "surrogate", "Co": "private-use", "Cn": "unassigned"}
ALLOWED_CONTROLS = frozenset("\n\t\r")
REPLACEMENT = "\ufffd"


def garbled_detail(text: str) -> str | None:
    """None for plain text; else what is wrong, as "3 control, 12 replacement characters"."""
    counts: dict[str, int] = {}
    for ch in text:
        if ch == REPLACEMENT:
            kind = "replacement"
        elif ch in ALLOWED_CONTROLS:
            continue
        else:
            kind = BAD_CATEGORIES.get(unicodedata.category(ch))
            if kind is None:
                continue
        counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return None
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) + " characters"

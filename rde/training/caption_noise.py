"""Hallucination-style caption noise: replace one or two grounded facts of a caption
with wrong ones of the same kind, keeping the sentence fluent, as an MLLM errs.

Kinds and their vocabularies come from what the grounded captioner measures
(``models/backends/attributes.py`` and ``measured_facts.IMAGENET_CUES``): garment colours
(``COLOURS`` and the unambiguous synonyms of ``COLOUR_SYNONYMS``; "dark", "light" and "bright"
are modifiers and stay), garments (upper-body, lower-body and whole-body garments, each swapped
within its group and grammatical number, so "jeans are" stays plural; the prompt's generic words
"top", "bottoms", "clothing" are not garments and stay), carried objects (``CARRIED``)
and directions (a documented list: the captioner measures none, so demo captions seldom have one).
A replacement never repeats a colour already in the caption ("black and gray" does not become
"gray and gray"); an article right before a replaced word is fixed ("a backpack" → "an umbrella");
capitalisation is kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from models.backends.attributes import COLOURS

# colour words that name one colour (COLOUR_SYNONYMS minus the modifiers): swapped to another base colour
COLOUR_WORDS = (*COLOURS, "grey", "silver", "navy", "maroon", "crimson", "beige", "tan", "khaki", "violet")
_COLOUR_BASE = {"grey": "gray", "silver": "gray", "navy": "blue", "maroon": "red", "crimson": "red",
                "beige": "brown", "tan": "brown", "khaki": "brown", "violet": "purple"}
# garments by group and grammatical number (from attributes.UPPER/LOWER/WHOLE and the ImageNet cues)
UPPER_GARMENTS = ("shirt", "t-shirt", "jacket", "coat", "sweater", "hoodie", "blouse", "vest", "jersey",
                  "sweatshirt", "cardigan", "blazer", "parka")
LOWER_GARMENTS_PLURAL = ("pants", "trousers", "jeans", "shorts", "leggings", "slacks")
WHOLE_GARMENTS = ("dress", "suit", "uniform", "kimono", "poncho")
CARRIED = ("backpack", "bag", "handbag", "suitcase", "umbrella")  # what the pedestrian domain's people carry
# "walking to the left", "in the right hand": the other side ("front"/"back" are left out: "a
# backpack on the back" would become "on the front")
DIRECTIONS = ("left", "right")

KINDS: dict[str, tuple[str, ...]] = {
    "colour": COLOUR_WORDS, "upper_garment": UPPER_GARMENTS, "lower_garment": LOWER_GARMENTS_PLURAL,
    "whole_garment": WHOLE_GARMENTS, "carried": CARRIED, "direction": DIRECTIONS,
}
_WORD = re.compile(r"[A-Za-z]+(?:-[A-Za-z]+)?")
_VOWEL_SOUND = re.compile(r"^[aeio]|^u(?!ni|s[eu])", re.I)  # "an orange", "an umbrella", "a uniform"


@dataclass(frozen=True)
class Swap:
    """One replaced fact: its kind, the word as it was, the word put in, and where (char offset in
    the original text)."""

    kind: str
    old: str
    new: str
    start: int


def _same(kind: str, a: str, b: str) -> bool:
    if kind == "colour":
        return _COLOUR_BASE.get(a, a) == _COLOUR_BASE.get(b, b)
    return a == b


def _match_case(word: str, like: str) -> str:
    return word.capitalize() if like[:1].isupper() else word


def _article(next_word: str, like: str) -> str:
    art = "an" if _VOWEL_SOUND.match(next_word) else "a"
    return art.capitalize() if like[:1].isupper() else art


def corrupt_caption(text: str, rng: np.random.Generator, max_swaps: int = 2,
                    kinds: Mapping[str, Sequence[str]] | None = None) -> tuple[str, list[Swap]]:
    """``text`` with one or ``max_swaps`` (drawn uniformly) known-kind words replaced by a
    different word of the same kind; ``(text, [])`` when it has no such word (or no other word of
    the kind to put in). Deterministic for a given ``rng`` state."""
    vocab = {k: tuple(v) for k, v in (KINDS if kinds is None else kinds).items()}
    kind_of = {w: k for k, words in vocab.items() for w in words}
    words = list(_WORD.finditer(text))
    candidates = [i for i, m in enumerate(words) if m.group(0).lower() in kind_of]
    if not candidates:
        return text, []
    present_colours = {_COLOUR_BASE.get(m.group(0).lower(), m.group(0).lower()) for m in words
                       if kind_of.get(m.group(0).lower()) == "colour"}
    n = int(rng.integers(1, max_swaps + 1))
    order = rng.permutation(len(candidates))
    replacements: dict[int, str] = {}
    swaps: list[Swap] = []
    for j in order:
        if len(swaps) == n:
            break
        i = candidates[int(j)]
        old = words[i].group(0).lower()
        kind = kind_of[old]
        options = [w for w in vocab[kind] if not _same(kind, w, old) and w not in replacements.values()
                   and not (kind == "colour" and _COLOUR_BASE.get(w, w) in present_colours)]
        if kind == "colour":
            options = [w for w in options if w in COLOURS or kinds is not None]  # put in base colours
        if not options:
            continue
        new = str(options[int(rng.integers(len(options)))])
        if kind == "colour":
            present_colours.add(new)
        replacements[i] = new
        swaps.append(Swap(kind, words[i].group(0), new, words[i].start()))
    if not swaps:
        return text, []
    pieces, pos = [], 0
    for i, m in enumerate(words):
        if i not in replacements:
            continue
        new = _match_case(replacements[i], m.group(0))
        before = text[pos:m.start()]
        if i > 0 and words[i - 1].end() <= m.start() and words[i - 1].group(0).lower() in ("a", "an") \
                and text[words[i - 1].end():m.start()].isspace() and words[i - 1].start() >= pos:
            prev = words[i - 1]
            before = text[pos:prev.start()] + _article(new, prev.group(0)) + text[prev.end():m.start()]
        pieces.append(before + new)
        pos = m.end()
    pieces.append(text[pos:])
    return "".join(pieces), sorted(swaps, key=lambda s: s.start)

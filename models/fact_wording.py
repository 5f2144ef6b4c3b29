"""Saying measured values in a prompt file's words: the one filler behind the caption pool's
rendered captions (``rde.secmm.sentence_checks.facts_caption``) and the grounded captioner's Q&A
answers (``models.backends.measured_facts.facts_qa_pairs``).

A value is said through the file's ``phrases`` for its attribute ("left" -> "to the left"), several
values joined with "and"; a template's ``{name}`` placeholders are attributes (``{value}``: the
entry's own), and a placeholder whose attribute was not measured leaves the template unsaid.
"""

from __future__ import annotations

import re

Phrases = dict[str, dict[str, str]]

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_SLOT = re.compile(r"\{(\w+)\}")
_ARTICLE = re.compile(r"\b([Aa]) ([aeiou])")  # "A orange car" -> "An orange car"


def join_values(words: list[str]) -> str:
    """"black", "black and blue", "black, blue and gray"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def say_values(attribute: str, values: list[str], phrases: Phrases) -> str:
    """``values`` of ``attribute`` through its phrases, joined ("" when none was measured)."""
    return join_values([phrases.get(attribute, {}).get(v, v) for v in values]) if values else ""


def fill_values(template: str, values: dict[str, list[str]], phrases: Phrases,
                attribute: str | None = None) -> str | None:
    """``template`` with its placeholders filled (``{value}`` is ``attribute``'s values), each value
    through ``phrases``; None when a placeholder was not measured."""
    fills = {}
    for name in _SLOT.findall(template):
        key = attribute if name == "value" and attribute else name
        if not values.get(key):
            return None
        fills[name] = say_values(key, values[key], phrases)
    return template.format(**fills)


def render_sentence(template: str, values: dict[str, list[str]], phrases: Phrases | None = None) -> str | None:
    """One sentence from measured ``values``. ``[a|b]`` is an optional group: its first
    alternative whose placeholders were all measured, else nothing. The sentence is None when a
    placeholder outside the groups was not measured, or when it states no measured value at all
    (a subject with nothing said about it)."""
    phrases = phrases or {}
    filled = 0

    def group(match: re.Match) -> str:
        nonlocal filled
        for option in match.group(1).split("|"):
            text = fill_values(option, values, phrases)
            if text is not None:
                filled += len(_SLOT.findall(option))
                return text
        return ""

    body = _GROUP.sub(group, template)
    if not filled and not _SLOT.search(body):
        return None
    text = fill_values(body, values, phrases)
    return None if text is None else _ARTICLE.sub(lambda m: m.group(1) + "n " + m.group(2), text)

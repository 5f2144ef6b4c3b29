"""Grammar-constrained DAP generation (``queries.constrained_decoding``): a GBNF grammar per request.

``build_grammar`` fills the prompt file's ``grammar`` template with phrases the caption pool
attests for the request's sampled keywords (``rde.common.caption_stats.noun_uses``), so every line
a backend able to honour the grammar writes uses a sampled noun or adjective and only pool words.
Split from ``rde.secmm.dap`` (the rounds, which call ``build_grammar`` once a request) because the
grammar is a subject of its own: the phrases, the keyword slots, the attested combinations.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

from models.prompt_files import PromptFile
from rde.common.caption_stats import NounUse
from rde.secmm.config import QueriesSpec


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

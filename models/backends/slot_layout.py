"""The attribute slots of a profile's domains: which slots an attribute vector has, in which order,
over which vocabularies, and the words a text fills them with (``SlotLayout``). The attribute
expert, the grounded captioner, DAP's near-duplicate rule, the diversity facets and the track slots
all read one layout per domain set (``slot_layout``). The colour vocabulary is the 11 basic colour
terms (named in ``attributes.colour_distribution``)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from models.domains import Domain, DomainSet

COLOURS = ["black", "white", "gray", "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown"]
# what a text can state that only a video track measures (track_facts): parsed for the near-
# duplicate rule and the diversity facets, not part of the image-side vector
DIRECTIONS = ["left", "right", "toward", "away"]


class SlotLayout:
    """The slots of a profile's domains, in vector order, and the words a text fills them with.

    Slots: ``domain`` (the domains' names), then per domain its type (the subject's classes), its
    regions' colours (the 11 basic terms), its carried and ridden objects (their classes). Text
    slots add ``motion`` (every domain's motion states) and ``direction``."""

    def __init__(self, domains: DomainSet) -> None:
        self.domains = domains
        self.slots: dict[str, list[str]] = {"domain": domains.names}
        self.kinds: dict[str, str] = {"domain": "domain"}
        for d in domains:
            for slot, kind in d.slot_kinds():
                self.kinds[slot] = kind
                self.slots[slot] = d.subject.classes if kind == "type" else COLOURS if kind == "colour" else \
                    [item.label for item in (d.carried if kind == "carried" else d.ridden).items]
        motions = list(dict.fromkeys(s.name for d in domains for s in d.motion))
        self.text_slots = {**self.slots, "motion": motions, "direction": DIRECTIONS}
        self.motion_text = {w: s.name for d in domains for s in d.motion for w in s.says}
        self.mentions = {d.name: self._mention_words(d) for d in domains}
        self.carried_words = {w: (d.carried.slot, item.label) for d in domains if d.carried
                              for item in d.carried.items for w in item.words}
        self.type_words = {w: (d.subject.types.slot, t) for d in domains if d.subject.types
                           for w, t in d.subject.types.words.items() if t is not None}

    @staticmethod
    def _mention_words(d: Domain) -> set[str]:
        words = set(d.subject.mentions) | set(d.appearance.whole_words)
        words |= {w for r in d.regions for w in r.words}
        return words | set(d.subject.types.words if d.subject.types else ())

    def of_kind(self, *kinds: str) -> list[str]:
        """The slots of the given kinds (``colour``, ``type``, ``carried``, ``ridden``)."""
        return [slot for slot, kind in self.kinds.items() if kind in kinds]

    def onehot(self, slot: str, value: str) -> np.ndarray:
        return np.array([float(v == value) for v in self.text_slots[slot]], np.float32)


@lru_cache(maxsize=16)
def slot_layout(domains: DomainSet) -> SlotLayout:
    """The layout of ``domains`` (kept: texts are parsed one at a time)."""
    return SlotLayout(domains)

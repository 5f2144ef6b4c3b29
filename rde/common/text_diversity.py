"""How varied a set of texts is: the measures the ``dap`` and ``caption-pool`` stages report per
domain (artifact table and manifest stats), so that a template-bound generator shows up in numbers.

* ``distinct_n``: distinct word n-grams over all n-grams of the texts (Li et al., 2016, "distinct-n");
  1.0 when no n-gram repeats, near 0 for one template with one slot.
* ``facets``: what kinds of fact a text states, from the attribute parser
  (``models.backends.attributes.parse_text_attributes``, in the profile's domains' slots):
  ``appearance`` (a colour of a region, a type), ``action`` (a motion, a direction, a ridden object),
  ``carried`` (a carried object), ``context`` (the distance to the camera, the place in the frame).
* ``diversity``: per domain, the texts, the distinct texts, the median length in words, distinct-1
  and distinct-2, the vocabulary size, the share of texts per facet and the share stating two
  facets or more.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from statistics import median
from typing import Any

from models.backends.attributes import parse_text_attributes
from models.backends.slot_layout import SlotLayout

_WORD = re.compile(r"[a-z]+(?:['-][a-z]+)*")
FACETS = ("appearance", "action", "carried", "context")
_CONTEXT_WORDS = {"near", "far", "close", "distant", "frame"}


def words(text: str) -> list[str]:
    """Lower-case words of ``text``."""
    return _WORD.findall(text.lower())


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Distinct n-grams / all n-grams over ``texts`` (0.0 when there is none)."""
    grams = [tuple(w[i : i + n]) for w in map(words, texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def facets(text: str, layout: SlotLayout) -> set[str]:
    """The facets ``text`` states (see the module docstring)."""
    attrs = parse_text_attributes(text, layout)
    found = set()
    if any(attrs.slots.get(s) is not None for s in layout.of_kind("colour", "type")):
        found.add("appearance")
    if any(attrs.slots.get(s) is not None for s in ("motion", "direction", *layout.of_kind("ridden"))):
        found.add("action")
    if any(attrs.slots.get(s) is not None for s in layout.of_kind("carried")):
        found.add("carried")
    if set(words(text)) & _CONTEXT_WORDS:
        found.add("context")
    return found


def diversity(texts: list[str], layout: SlotLayout) -> dict[str, Any]:
    """The diversity summary of one domain's texts (see the module docstring)."""
    if not texts:
        return {"texts": 0}
    found = [facets(t, layout) for t in texts]
    out: dict[str, Any] = {
        "texts": len(texts), "distinct_texts": len(set(texts)),
        "median_words": float(median(len(words(t)) for t in texts)),
        "distinct_1": round(distinct_n(texts, 1), 4), "distinct_2": round(distinct_n(texts, 2), 4),
        "vocabulary": len({w for t in texts for w in words(t)}),
        "facets_used": sum(1 for f in FACETS if any(f in x for x in found)),
        "two_or_more_facets": round(sum(len(x) >= 2 for x in found) / len(texts), 4),
    }
    out.update({f"facet_{f}": round(sum(f in x for x in found) / len(texts), 4) for f in FACETS})
    return out


def diversity_by_domain(rows: list[dict[str, Any]], layout: SlotLayout) -> list[dict[str, Any]]:
    """``diversity`` per domain of rows with ``domain`` and ``text``, domains in sorted order."""
    return [{"domain": d, **diversity([r["text"] for r in rows if r["domain"] == d], layout)}
            for d in sorted({r["domain"] for r in rows})]


def diversity_line(summaries: list[dict[str, Any]]) -> str:
    """One log line for ``diversity_by_domain``'s rows: "pedestrian 30 distinct, distinct-2 0.52, ..."."""
    return "; ".join(f"{s['domain']}: {s.get('distinct_texts', 0)} distinct of {s.get('texts', 0)}, "
                     f"distinct-2 {s.get('distinct_2', 0)}, median {s.get('median_words', 0)} words, "
                     f"vocabulary {s.get('vocabulary', 0)}, {s.get('facets_used', 0)} facets, "
                     f"{s.get('two_or_more_facets', 0):.0%} with two or more" for s in summaries) or "no texts"

"""The GTR+ template gallery (paper Sec. 3.1.3): extract sentence templates with typed slots from
tier-1/2 captions, expand them into new ones, validate and de-duplicate. The gallery is versioned by
the hash of its accepted templates and stored as an artifact, so each advanced-tier caption names
the template (and gallery) it was written from."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult
from rde.caption_quality import word_count
from rde.prompt_files import PromptFile
from rde.qa_pairs import has_qa_markers
from storage.hashing import sha256_json

_SLOT = re.compile(r"\[([^\[\]]+)\]")
_ITEM = re.compile(r"^\s*(?:\d+\s*[.)]|[-*•])\s*")


@dataclass(frozen=True)
class Template:
    template_id: str
    text: str
    slots: tuple[str, ...]
    origin: str  # seed | extracted | expanded
    round: int


@dataclass(frozen=True)
class RejectedTemplate:
    text: str
    reason: str
    detail: str
    origin: str
    round: int


def normalise_slot(name: str) -> str:
    return " ".join(name.lower().split())


def template_key(text: str) -> str:
    """De-duplication key: lower-case words with slot names kept, punctuation ignored."""
    return " ".join(re.findall(r"\[[^\]]+\]|[a-z0-9]+", text.lower()))


def template_id(text: str) -> str:
    return "t-" + sha256_json(template_key(text))[:12]


def split_template_lines(text: str) -> list[str]:
    """Candidate templates in generator output: one per line, list numbering removed."""
    lines = []
    for line in re.split(r"\n|(?<=[.!?])\s+(?=\d+\s*[.)]\s)", text):
        cleaned = _ITEM.sub("", line).strip().strip('"').strip()
        if cleaned:
            lines.append(cleaned)
    return lines


def validate_template(text: str, allowed_slots: Sequence[str], min_words: int,
                      max_words: int) -> tuple[str, str] | None:
    """None if ``text`` is a usable template, else (reason, detail).

    Usable: at least one slot, every slot in the vocabulary, balanced brackets, no Q/A markers, and
    between ``min_words`` and ``max_words`` words (slots count as one word each).
    """
    if "[" in _SLOT.sub("", text) or "]" in _SLOT.sub("", text):
        return "malformed_template", "unbalanced or nested brackets"
    slots = [normalise_slot(s) for s in _SLOT.findall(text)]
    if not slots:
        return "no_slot", "a template needs at least one [slot]"
    allowed = {normalise_slot(s) for s in allowed_slots}
    unknown = sorted({s for s in slots if s not in allowed})
    if unknown:
        return "unknown_slot", f"slots not in the vocabulary: {unknown}"
    if has_qa_markers(text):
        return "malformed_template", "contains Q:/A: markers"
    words = word_count(_SLOT.sub("slot", text))
    if words < min_words:
        return "too_short", f"{words} words < {min_words}"
    if words > max_words:
        return "too_long", f"{words} words > {max_words}"
    return None


@dataclass
class Gallery:
    """Accepted templates (seeds first) and every rejected candidate with its reason."""

    templates: list[Template]
    rejected: list[RejectedTemplate]

    @property
    def version(self) -> str:
        """The gallery's identity: hash of its accepted templates in order."""
        return "gallery-" + sha256_json([t.text for t in self.templates])[:12]

    def choose(self, seed: int) -> Template:
        return self.templates[int(np.random.default_rng(seed).integers(len(self.templates)))]


class GalleryBuilder:
    """Adds candidates one by one: validate, de-duplicate, cap at ``max_templates``."""

    def __init__(self, allowed_slots: Sequence[str], min_words: int, max_words: int, max_templates: int) -> None:
        self.allowed_slots, self.min_words, self.max_words = list(allowed_slots), min_words, max_words
        self.max_templates = max_templates
        self.gallery = Gallery([], [])
        self._keys: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.gallery.templates) >= self.max_templates

    def add(self, text: str, origin: str, round_: int) -> bool:
        bad = validate_template(text, self.allowed_slots, self.min_words, self.max_words)
        if bad is None and template_key(text) in self._keys:
            bad = ("duplicate", "same template as an accepted one")
        if bad is None and self.full:
            bad = ("gallery_full", f"gallery already holds {self.max_templates} templates")
        if bad is not None:
            self.gallery.rejected.append(RejectedTemplate(text, bad[0], bad[1], origin, round_))
            return False
        self._keys.add(template_key(text))
        slots = tuple(normalise_slot(s) for s in _SLOT.findall(text))
        self.gallery.templates.append(Template(template_id(text), text, slots, origin, round_))
        return True


GenerateFn = Callable[[list[GenerationRequest]], list[GenerationResult]]


def build_gallery(generate: GenerateFn, captions: Sequence[str], prompt: PromptFile, *, captions_per_request: int,
                  rounds: int, max_templates: int, min_words: int, max_words: int, max_tokens: int,
                  temperature: float, seed: int) -> Gallery:
    """Seeds, then one extraction round over ``captions``, then ``rounds`` expansion rounds, each
    showing the generator a sample of the current gallery. Failed calls become rejected rows."""
    slots = list(prompt.extras["slots"])
    builder = GalleryBuilder(slots, min_words, max_words, max_templates)
    for text in prompt.extras.get("seeds", []):
        builder.add(str(text), "seed", 0)
    slot_list = ", ".join(f"[{s}]" for s in slots)
    rng = np.random.default_rng(seed)

    def run(requests: list[GenerationRequest], origin: str, round_: int) -> None:
        for result in generate(requests):
            if not result.ok:
                builder.gallery.rejected.append(RejectedTemplate("", "generation_failed", result.error or "",
                                                                 origin, round_))
                continue
            for line in split_template_lines(result.text):
                builder.add(line, origin, round_)

    chunks = [list(captions[i:i + captions_per_request]) for i in range(0, len(captions), captions_per_request)]
    run([GenerationRequest(f"extract-{i}", [ChatMessage("user", prompt.render(
        "extract", slots=slot_list, captions="\n".join(f"{j}. {c}" for j, c in enumerate(chunk, 1))))],
        max_tokens=max_tokens, temperature=temperature, seed=seed + i) for i, chunk in enumerate(chunks)],
        "extracted", 1)
    for round_ in range(2, rounds + 2):
        if builder.full:
            break
        current = builder.gallery.templates
        shown = [current[i] for i in rng.choice(len(current), size=min(6, len(current)), replace=False)]
        run([GenerationRequest(f"expand-{round_}", [ChatMessage("user", prompt.render(
            "expand", slots=slot_list, templates="\n".join(f"{j}. {t.text}" for j, t in enumerate(shown, 1))))],
            max_tokens=max_tokens, temperature=temperature, seed=seed + 1000 * round_)], "expanded", round_)
    return builder.gallery

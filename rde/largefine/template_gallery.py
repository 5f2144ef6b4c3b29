"""The GTR+ template gallery (paper Sec. 3.1.3): extract sentence templates with typed slots from
tier-1/2 captions, expand them into new ones, validate and de-duplicate. The gallery is versioned by
the hash of its accepted templates and stored as an artifact, so each advanced-tier caption names
the template (and gallery) it was written from."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult
from models.prompt_files import PromptFile
from rde.common.reasons import Reason
from rde.largefine.caption_quality import word_count
from rde.largefine.qa_pairs import has_qa_markers
from storage import Artifact
from storage.hashing import sha256_json

_SLOT = re.compile(r"\[([^\[\]]+)\]")
_ITEM = re.compile(r"^\s*(?:\d+\s*[.)]|[a-z][.)](?=\s)|[-*•])\s*")  # "1.", "2)", "a.", "-"
# Slots separated only by list punctuation/conjunctions (or a label colon) form one run: a possible slot list.
_SLOT_RUN = re.compile(r"\[[^\[\]]+\](?:\s*(?:,|;|:|/|\band\b|\bor\b)\s*(?:\band\b\s*)?\[[^\[\]]+\])+", re.I)
# Dependency labels and tags of spaCy's English pipeline used by the structural test.
_SUBJECT_DEPS = {"nsubj", "nsubjpass", "csubj", "csubjpass", "expl"}
_NAMING_DEPS = {"poss", "conj", "appos"}  # "their outfit", "the person and their bag": names the person
_OF_PREPOSITIONS = {"of"}  # "the details of the person"
_DESCRIPTION_START_TAGS = {"VBG", "VBN", "IN", "JJ"}  # "Wearing ...", "Dressed in ...", "In ...", "Tall, ..."


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


def validate_template(text: str, allowed_slots: Sequence[str], min_words: int, max_words: int,
                      measurable_slots: Sequence[str] | None = None) -> tuple[str, str] | None:
    """None if ``text`` is a usable template, else (reason, detail).

    Usable: at least one slot, none twice, every slot in the vocabulary (and, when given, in
    ``measurable_slots``: a captioner that states only what it measured fills no hair or shoes
    slot), balanced brackets, no Q/A markers, and between ``min_words`` and ``max_words`` words
    (slots count as one word each).
    """
    if "[" in _SLOT.sub("", text) or "]" in _SLOT.sub("", text):
        return "malformed_template", "unbalanced or nested brackets"
    slots = [normalise_slot(s) for s in _SLOT.findall(text)]
    if not slots:
        return "no_slot", "a template needs at least one [slot]"
    repeated = sorted({s for s in slots if slots.count(s) > 1})
    if repeated:
        return str(Reason.REPEATED_SLOT), f"slots used twice (the same detail would be written twice): {repeated}"
    allowed = {normalise_slot(s) for s in allowed_slots}
    unknown = sorted({s for s in slots if s not in allowed})
    if unknown:
        return "unknown_slot", f"slots not in the vocabulary: {unknown}"
    if measurable_slots is not None:
        unmeasurable = sorted({s for s in slots} - {normalise_slot(m) for m in measurable_slots})
        if unmeasurable:
            return str(Reason.UNMEASURABLE_SLOT), f"slots the captioner does not measure: {unmeasurable}"
    if has_qa_markers(text):
        return "malformed_template", "contains Q:/A: markers"
    words = word_count(_SLOT.sub("slot", text))
    if words < min_words:
        return "too_short", f"{words} words < {min_words}"
    if words > max_words:
        return "too_long", f"{words} words > {max_words}"
    return None


@dataclass(frozen=True)
class CaptionPatternRules:
    """Data of the caption-pattern check (prompt file's ``caption_pattern`` block), kept out of code."""

    person_slot: str
    stand_ins: dict[str, str]
    default_stand_in: str
    person_words: frozenset[str]
    meta_words: frozenset[str]
    meta_phrases: tuple[str, ...]
    slot_list_min: int
    concrete_words: frozenset[str]

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> CaptionPatternRules:
        """Rules from the prompt file's ``caption_pattern`` mapping (words lower-cased)."""
        return cls(person_slot=normalise_slot(data["person_slot"]),
                   stand_ins={normalise_slot(k): str(v) for k, v in data["stand_ins"].items()},
                   default_stand_in=str(data["default_stand_in"]),
                   person_words=frozenset(str(w).lower() for w in data["person_words"]),
                   meta_words=frozenset(str(w).lower() for w in data["meta_words"]),
                   meta_phrases=tuple(str(p).lower() for p in data["meta_phrases"]),
                   slot_list_min=int(data["slot_list_min"]),
                   concrete_words=frozenset(str(w).lower() for w in data["concrete_words"]))


class CaptionPatternCheck:
    """Is a candidate a caption pattern (a description of the person with slots) rather than the
    generator talking about the task or itself? spaCy's parse of the candidate with slots replaced by
    stand-ins first (no first/second person, no instruction, each sentence's subject is the person or
    the sentence is a noun phrase or description about them), then the prompt file's cue lists."""

    def __init__(self, rules: CaptionPatternRules, nlp: Any = None) -> None:
        self.rules = rules
        self._nlp = nlp
        self._phrases = [re.compile(r"(?<![\w'])" + re.escape(p).replace(r"\ ", r"\s+") + r"(?![\w'-])", re.I)
                         for p in rules.meta_phrases]

    @property
    def nlp(self) -> Any:
        """The spaCy pipeline, loaded on first use (the repo's shared loader)."""
        if self._nlp is None:
            from rde.common.caption_stats import load_tagger

            self._nlp = load_tagger()
        return self._nlp

    def stand_in(self, text: str) -> str:
        """``text`` with every slot replaced by its stand-in, so it parses as an ordinary sentence."""
        return _SLOT.sub(lambda m: self.rules.stand_ins.get(normalise_slot(m.group(1)), self.rules.default_stand_in),
                         text)

    def __call__(self, text: str) -> tuple[str, str] | None:
        """None if ``text`` reads as a caption pattern, else (reason, detail).

        The parse decides first; cue words then turn a structural failure (or a structurally fine
        sentence) into ``meta_commentary``; then a kept concrete detail is ``concrete_detail``; a
        structural failure without either is ``not_about_person``.
        """
        doc = self.nlp(self.stand_in(text))
        structural = self.structure(doc)
        if structural is not None and structural[0] == Reason.META_COMMENTARY:
            return structural
        cue = self.cues(text, doc)
        if cue is not None:
            return cue[0], "; ".join(d for d in (structural[1] if structural else "", cue[1]) if d)
        concrete = sorted({w for w in re.findall(r"[a-z]+", _SLOT.sub(" ", text).lower())
                           if w in self.rules.concrete_words})
        if concrete:
            return str(Reason.CONCRETE_DETAIL), f"keeps details a slot should carry: {concrete}"
        return structural

    def structure(self, doc: Any) -> tuple[str, str] | None:
        """The parse alone: no first/second person, and every sentence about the person."""
        for token in doc:
            if token.pos_ == "PRON" and set(token.morph.get("Person")) & {"1", "2"}:
                return str(Reason.META_COMMENTARY), f"speaks in the first/second person ({token.text!r})"
        for sent in doc.sents:
            bad = self._sentence(sent)
            if bad is not None:
                return bad
        return None

    def cues(self, text: str, doc: Any) -> tuple[str, str] | None:
        """Chatter the parse cannot name: a trailing colon, a slot list, a framing phrase, a meta word."""
        meta = str(Reason.META_COMMENTARY)
        if text.rstrip().endswith(":"):
            return meta, "ends with a colon (introduces something else)"
        for run in _SLOT_RUN.finditer(text):
            slots = [normalise_slot(s) for s in _SLOT.findall(run.group(0))]
            if len(slots) >= self.rules.slot_list_min and self.rules.person_slot in slots:
                return meta, f"lists slots: {run.group(0)}"
        bare = _SLOT.sub(" ", text)
        for phrase, pattern in zip(self.rules.meta_phrases, self._phrases, strict=True):
            if pattern.search(bare):
                return meta, f"framing phrase {phrase!r}"
        for token in doc:
            if token.lemma_.lower() in self.rules.meta_words or token.lower_ in self.rules.meta_words:
                return meta, f"talks about the task ({token.text!r})"
        return None

    def _is_person(self, token: Any) -> bool:
        """A person word (or the person slot's stand-in) by form or lemma."""
        return token.lower_ in self.rules.person_words or token.lemma_.lower() in self.rules.person_words

    def _names_person(self, token: Any) -> bool:
        """``token``'s phrase is about the person: it is one, is theirs, or is "X of the person" (a
        person word elsewhere in the phrase, as in "a template for the person", does not count)."""
        if self._is_person(token):
            return True
        for child in token.children:
            if child.dep_ in _NAMING_DEPS and self._names_person(child):
                return True
            if child.dep_ == "prep" and child.lower_ in _OF_PREPOSITIONS and any(
                    g.dep_ == "pobj" and self._names_person(g) for g in child.children):
                return True
        return False

    def _sentence(self, sent: Any) -> tuple[str, str] | None:
        """A sentence is about the person if its subject mentions them; without a subject, if it is a
        noun phrase headed by the person, or starts with a description and names the person."""
        root = sent.root
        subjects = [t for t in sent if t.dep_ in _SUBJECT_DEPS and t.head == root]
        if subjects:
            if any(self._names_person(s) for s in subjects):
                return None
            return str(Reason.NOT_ABOUT_PERSON), f"subject {subjects[0].text!r} is not the person: {sent.text!r}"
        if self._is_person(root):
            return None
        if root.tag_ == "VB" and root.i == sent.start:
            return str(Reason.META_COMMENTARY), f"an instruction ({root.text!r}): {sent.text!r}"
        if sent[0].tag_ in _DESCRIPTION_START_TAGS and any(self._is_person(t) for t in sent):
            return None
        return str(Reason.NOT_ABOUT_PERSON), f"neither a subject nor a description of the person: {sent.text!r}"


@dataclass
class Gallery:
    """Accepted templates (seeds first) and every rejected candidate with its reason."""

    templates: list[Template]
    rejected: list[RejectedTemplate]
    candidates: int = 0  # seeds + lines the generator returned + failed calls: the input, counted as offered

    @property
    def version(self) -> str:
        """The gallery's identity: hash of its accepted templates in order."""
        return "gallery-" + sha256_json([t.text for t in self.templates])[:12]

    def choose(self, seed: int) -> Template:
        return self.templates[int(np.random.default_rng(seed).integers(len(self.templates)))]


PatternCheck = Callable[[str], tuple[str, str] | None]


class GalleryBuilder:
    """Adds candidates one by one: validate, check it is a caption pattern (when ``pattern_check`` is
    given), de-duplicate, cap at ``max_templates``."""

    def __init__(self, allowed_slots: Sequence[str], min_words: int, max_words: int, max_templates: int,
                 pattern_check: PatternCheck | None = None, measurable_slots: Sequence[str] | None = None) -> None:
        self.allowed_slots, self.min_words, self.max_words = list(allowed_slots), min_words, max_words
        self.measurable_slots = measurable_slots
        self.max_templates = max_templates
        self.pattern_check = pattern_check
        self.gallery = Gallery([], [])
        self._keys: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.gallery.templates) >= self.max_templates

    def add(self, text: str, origin: str, round_: int) -> bool:
        self.gallery.candidates += 1
        bad = validate_template(text, self.allowed_slots, self.min_words, self.max_words, self.measurable_slots)
        if bad is None and self.pattern_check is not None:
            bad = self.pattern_check(text)
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
                  temperature: float, seed: int, nlp: Any = None,
                  measurable_slots: Sequence[str] | None = None) -> Gallery:
    """Seeds, then one extraction round over ``captions``, then ``rounds`` expansion rounds, each
    showing the generator a sample of the current gallery. Failed calls become rejected rows; with a
    ``caption_pattern`` block in the prompt file, every candidate must read as a caption pattern.
    ``measurable_slots`` (None: all): the slots the captioner can fill from what it measures; only
    those are offered to the generator, and a template with another is ``unmeasurable_slot``."""
    slots = list(prompt.extras["slots"])
    rules = prompt.extras.get("caption_pattern")
    check = CaptionPatternCheck(CaptionPatternRules.from_mapping(rules), nlp) if rules else None
    builder = GalleryBuilder(slots, min_words, max_words, max_templates, check, measurable_slots)
    for text in prompt.extras.get("seeds", []):
        builder.add(str(text), "seed", 0)
    offered = [s for s in slots if measurable_slots is None
               or normalise_slot(s) in {normalise_slot(m) for m in measurable_slots}]
    slot_list = ", ".join(f"[{s}]" for s in offered)
    rng = np.random.default_rng(seed)

    def run(requests: list[GenerationRequest], origin: str, round_: int) -> None:
        for result in generate(requests):
            if not result.ok:
                builder.gallery.candidates += 1
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


def load_gallery(url: str) -> Gallery:
    """The template gallery written by the template-gallery stage at ``url``."""
    rows = Artifact(url).rows()
    return Gallery([Template(r["template_id"], r["text"], tuple(r["slots"]), r["origin"], r["round"])
                    for r in rows], [])

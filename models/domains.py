"""Domains as data: what a benchmark's subject is and how it is measured, said and asked about.

A domain is one YAML file (bundled ones in ``domains/``; a user's anywhere, named by path in a
profile's ``domains`` list), validated here at load. It declares:

* the **subject**: the detector classes that make one (and the free-text names an
  open-vocabulary detector looks for), the nouns that name it, how a caption refers to it, its
  size rule, and, where the detector's class is itself an attribute (a car, a bus), its **types**;
* the **regions** of the subject's box whose colour is measured (a band of rows, how the colour is
  said, the words a text uses for the region);
* what the subject may **carry** (objects mostly inside its box) or **ride** (objects under it);
* its **motion** vocabulary: states with their speed thresholds (box heights per second);
* its **texts**: the DAP prompt and the words a query must use, the caption request and the
  sentences a caption is rendered in, the Q&A asked about each measured fact.

Every consumer (the attribute expert, the grounded captioner, the track facts, DAP, the caption
pool and the tiers) reads these fields; none branches on a domain's name.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from models.specs import Strict
from storage.hashing import sha256_json

DOMAIN_DIR = Path(__file__).resolve().parents[1] / "domains"
_NAME = r"^[a-z][a-z0-9_]*$"


class DomainError(ValueError):
    """A domain file could not be loaded; the message names the file and the field."""


class SizeRule(Strict):
    """A minimum image size: narrower or lower images are too_small."""

    min_width: int = Field(ge=1, description="Narrower images are too_small (pixels).")
    min_height: int = Field(ge=1, description="Lower images are too_small (pixels).")


class SubjectTypes(Strict):
    """The subject's kind as an attribute (a car, a bus): the detector's class, said when an
    ImageNet classifier does not contradict it (``classifier``: ImageNet class → type, "other" for
    kinds of none of the types; evidence rule in ``measured_facts.type_agrees``)."""

    slot: str = Field(pattern=_NAME, description="The attribute slot of the type (its vocabulary: subject.classes).")
    fact: str = Field(pattern=_NAME, description="The fact's name in captions and Q&A (e.g. vehicle_type).")
    words: dict[str, str | None] = Field(default_factory=dict, description="Word in a text → the type it "
                                         "names (null: names the subject without a type).")
    classifier: dict[str, str] = Field(default_factory=dict, description="ImageNet class → the type it "
                                       "supports ('other': a kind of none of the types).")
    support: float = Field(0.05, ge=0.0, le=1.0, description="A type stands when its own ImageNet evidence "
                           "reaches this.")
    contradiction: float = Field(0.1, ge=0.0, le=1.0, description="... or when no other type's evidence "
                                 "reaches this.")


class Subject(Strict):
    """What makes a subject of this domain and how it is named."""

    classes: list[str] = Field(min_length=1, description="Detector class names that count as this domain's "
                               "subject (e.g. person; car, bus, truck).")
    open_vocabulary: list[str] = Field(default_factory=list, description="Free-text names an open-vocabulary "
                                       "detector looks for, one per class (default: the class names).")
    noun: str = Field(description="The word a fact line names the subject with ('subject: a person').")
    said_as: str = Field(description="How an answer refers to the subject ('the person').")
    plural: str | None = Field(None, description="The noun's plural, as a tier prompt compares two subjects "
                               "(default: the noun + s).")
    missing: str | None = Field(None, description="The fact line when no subject is detected (the first "
                                "domain's, whose regions are then measured over the whole image).")
    nouns: list[str] = Field(min_length=1, description="Words that name the subject: a generated query must "
                             "use one (DAP's off_domain check and its grammar's subjects).")
    mentions: list[str] = Field(default_factory=list, description="Words that tell a text is about this "
                                "domain (with nouns, the regions' words and the types' words).")
    allowed: list[str] = Field(default_factory=list, description="Words a caption about this subject may "
                               "always use (they state no attribute).")
    size: SizeRule | None = Field(None, description="The domain's minimum crop size (default: the profile's "
                                  "denoise.min_width/min_height).")
    types: SubjectTypes | None = Field(None, description="The detector's class said as an attribute.")

    @model_validator(mode="after")
    def _one_name_per_class(self) -> Subject:
        if self.open_vocabulary and len(self.open_vocabulary) != len(self.classes):
            raise ValueError(f"open_vocabulary: one name per class, got {len(self.open_vocabulary)} names for "
                             f"{len(self.classes)} classes")
        return self

    @property
    def plural_noun(self) -> str:
        return self.plural or f"{self.noun}s"

    @property
    def text_names(self) -> list[str]:
        """The names an open-vocabulary detector is asked for, in class order."""
        return self.open_vocabulary or self.classes


class Region(Strict):
    """A band of the subject's box whose colour is measured."""

    slot: str = Field(pattern=_NAME, description="The attribute slot (vocabulary: the 11 basic colour terms).")
    fact: str = Field(pattern=_NAME, description="The fact's name in captions and Q&A (e.g. top).")
    band: tuple[float, float] = Field(description="Rows of the box, as shares of its height from the top.")
    side: float = Field(0.2, ge=0.0, lt=0.5, description="Columns left out on each side when no subject mask "
                        "is used (share of the width).")
    line: str = Field(description="The fact line's label ('upper-body clothing colour').")
    words: list[str] = Field(default_factory=list, description="Words a text names the region with (a colour "
                             "next to one is this region's); a domain with no worded region gives every "
                             "colour of a text about it to its first region.")
    colours: int = Field(2, ge=1, description="Colours said at most.")

    @field_validator("band")
    @classmethod
    def _band_in_box(cls, band: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= band[0] < band[1] <= 1.0:
            raise ValueError(f"band must be two shares 0 <= top < bottom <= 1, got {list(band)}")
        return band


class HeldItem(Strict):
    """One kind of object the subject carries or rides."""

    label: str = Field(description="The detector's class name.")
    words: list[str] = Field(min_length=1, description="Words a text names it with (the first is how it is said).")


class Held(Strict):
    """Objects that belong to the subject: carried (overlapping its box) or ridden (under it)."""

    slot: str = Field(pattern=_NAME, description="The attribute slot.")
    fact: str = Field(pattern=_NAME, description="The fact's name in captions and Q&A (e.g. carried).")
    relation: Literal["overlap", "under"] = Field(description="overlap: mostly inside the subject's box; under: "
                                                  "under its lower half, its feet no lower than the object's "
                                                  "bottom edge (a rider).")
    line: str = Field(description="The fact line's label ('carried objects').")
    none: str | None = Field(None, description="The line's value when nothing is found (null: no line).")
    value: str = Field("{items}", description="How the line says what was found ('a {items}').")
    items: list[HeldItem] = Field(min_length=1, description="The objects.")
    verbs: list[str] = Field(default_factory=list, description="Words a caption may use once one is found "
                             "('riding').")
    at_most: int | None = Field(None, ge=1, description="Objects said at most (null: all found).")


class MotionState(Strict):
    """A motion state and the speeds (box heights per second) it covers: below ``below``, or from
    ``at_least`` up to the next state's ``at_least``."""

    name: str = Field(pattern=_NAME, description="The state ('walking').")
    below: float | None = Field(None, ge=0.0, description="Slower than this is this state.")
    at_least: float | None = Field(None, ge=0.0, description="At least this fast (and below the next faster "
                                   "state) is this state; such a state has a direction.")
    says: list[str] = Field(min_length=1, description="Words that state it in a text ('walks', 'walking').")
    also: list[str] = Field(default_factory=list, description="Further words a caption may use once it is "
                            "measured ('still').")

    @model_validator(mode="after")
    def _one_threshold(self) -> MotionState:
        if (self.below is None) == (self.at_least is None):
            raise ValueError(f"motion state {self.name!r}: give exactly one of below and at_least")
        return self


class Appearance(Strict):
    """How the subject's pixels are measured."""

    mask: bool = Field(False, description="Measure the regions over the subject's own pixels (GrabCut "
                       "initialised with its box) rather than the box's central columns.")
    tone: bool = Field(False, description="Say the clothing's tone (dark/light) from its median lightness.")
    whole_words: list[str] = Field(default_factory=list, description="Words for the whole subject's covering "
                                   "('dress'): a colour next to one is every worded region's, at half weight.")


class Queries(Strict):
    """Distribution-aware query generation for this domain."""

    prompt: str = Field(description="The DAP prompt file (a name in prompts/ or a path).")
    subject: str = Field("", description="How the prompt names the subject in plural ('cyclists'; {subject} "
                         "in a generic prompt).")
    examples: list[str] = Field(default_factory=list, description="Few-shot example queries ({examples} in a "
                                "generic prompt; also what a kept query must not echo).")


class Captions(Strict):
    """The caption pool's request and the sentences a caption is rendered in from the facts."""

    request: str = Field(description="What a generator is asked about one image.")
    attributes: list[str] = Field(default_factory=list, description="What a describer model's tier Q&A asks "
                                  "about (the tier prompt's {attributes}; default: the prompt's own list, "
                                  "written for people).")
    from_facts: dict[str, Any] = Field(default_factory=dict, description="Sentences rendered from measured "
                                       "values (rde/secmm/sentence_checks.py render_sentence).")


class Templates(Strict):
    """The advanced tier's template gallery for this domain (default: the gallery prompt file's, for
    people): its slots, the slot and words that make the subject a template's topic, its seeds."""

    slots: list[str] = Field(min_length=1, description="Slots a template may use, in square brackets "
                             "('[cyclist]', '[clothing description]').")
    subject_slot: str = Field(description="The slot that names the subject (one of slots).")
    subject_words: list[str] = Field(default_factory=list, description="Words that make a sentence about the "
                                     "subject (with subject.nouns and the prompt's person words).")
    stand_ins: dict[str, str] = Field(default_factory=dict, description="Words a slot is read as when a "
                                      "template is parsed ('[cyclist]': cyclist; others: the prompt's).")
    seeds: list[str] = Field(default_factory=list, description="Hand-written templates the gallery starts from.")
    measurable: list[str] | None = Field(None, description="The slots the captioner can fill from what it "
                                         "measures (null: all).")

    @model_validator(mode="after")
    def _subject_is_a_slot(self) -> Templates:
        if self.subject_slot not in self.slots:
            raise ValueError(f"subject_slot {self.subject_slot!r} is not one of slots {self.slots}")
        return self


class Domain(Strict):
    """A validated domain file."""

    _source: str = PrivateAttr("(inline)")  # the file it was read from, for messages

    name: str = Field(pattern=_NAME, description="The domain's name, as rows, folders and reports use it.")
    description: str = Field("", description="What the domain is.")
    subject: Subject = Field(description="What makes a subject of this domain and how it is named.")
    appearance: Appearance = Field(Appearance(), description="How the subject's pixels are measured.")
    regions: list[Region] = Field(default_factory=list, description="Bands of the subject's box whose colour "
                                  "is measured and said.")
    carried: Held | None = Field(None, description="Objects the subject carries (overlapping its box).")
    ridden: Held | None = Field(None, description="Objects the subject rides (under it).")
    motion: list[MotionState] = Field(default_factory=list, description="Motion states, slowest first.")
    queries: Queries = Field(description="Distribution-aware query generation (DAP) for this domain.")
    captions: Captions = Field(description="The caption pool's request and the sentences rendered from facts.")
    questions: dict[str, Any] = Field(default_factory=dict, description="Q&A asked about each measured fact "
                                      "(the grounded captioner's qa_single entries).")
    comparisons: dict[str, Any] = Field(default_factory=dict, description="Q&A comparing two subjects per "
                                        "fact (qa_compare entries).")
    templates: Templates | None = Field(None, description="The advanced tier's template gallery (default: the "
                                        "gallery prompt file's, written for people).")

    @model_validator(mode="after")
    def _slots_unique(self) -> Domain:
        names = [s for s, _ in self.slot_kinds()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"slots {repeated} are declared twice")
        return self

    @property
    def target_classes(self) -> list[str]:
        return self.subject.classes

    @property
    def source(self) -> str:
        """The file the domain was read from ("(inline)" for a profile's own mapping)."""
        return self._source

    def detector_classes(self) -> list[tuple[str, str, str]]:
        """(class, text name, field) of every class the detector must know: the subject's, the
        carried and ridden objects'."""
        out = [(c, t, "subject.classes") for c, t in zip(self.subject.classes, self.subject.text_names, strict=True)]
        for where, held in (("carried", self.carried), ("ridden", self.ridden)):
            out += [(item.label, item.label, f"{where}.items") for item in (held.items if held else [])]
        return out

    def slot_kinds(self) -> list[tuple[str, str]]:
        """(slot, kind) in vector order: the type, the regions' colours, carried, ridden."""
        out = [(self.subject.types.slot, "type")] if self.subject.types else []
        out += [(r.slot, "colour") for r in self.regions]
        out += [(h.slot, kind) for h, kind in ((self.carried, "carried"), (self.ridden, "ridden")) if h]
        return out

    def state(self, speed: float) -> MotionState | None:
        """The motion state of a subject moving at ``speed``: a ``below`` state it is under, else the
        fastest ``at_least`` state it reaches, else None (between the thresholds nothing is said)."""
        for s in self.motion:
            if s.below is not None and speed < s.below:
                return s
        reached = [s for s in self.motion if s.at_least is not None and speed >= s.at_least]
        return max(reached, key=lambda s: s.at_least, default=None)


class DomainSet:
    """The profile's domains, in order: the first is the fallback subject (measured over the whole
    image when nothing is detected) and wins when a text mentions several."""

    def __init__(self, domains: list[Domain] | tuple[Domain, ...]) -> None:
        if not domains:
            raise DomainError("a profile needs at least one domain")
        self.domains = tuple(domains)
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise DomainError(f"domains: names must be unique, got {names}")
        owner: dict[str, str] = {}
        for d in self.domains:
            for cls in d.subject.classes:
                if cls in owner:
                    raise DomainError(f"domain file {d.source}: subject.classes: domains {owner[cls]!r} and "
                                      f"{d.name!r} both claim the detector class {cls!r} (a detection must "
                                      "have one domain)")
                owner[cls] = d.name
        slots: dict[str, str] = {}
        for d in self.domains:
            for slot, _ in d.slot_kinds():
                if slot in slots:
                    raise DomainError(f"domain file {d.source}: slots: domains {slots[slot]!r} and {d.name!r} "
                                      f"both declare the slot {slot!r}: name the second one apart")
                slots[slot] = d.name

    def __iter__(self):
        return iter(self.domains)

    def __len__(self) -> int:
        return len(self.domains)

    def __getitem__(self, name: str) -> Domain:
        for d in self.domains:
            if d.name == name:
                return d
        raise KeyError(name)

    def get(self, name: str) -> Domain | None:
        """The domain called ``name``, or None (a row of a domain the profile no longer has)."""
        return next((d for d in self.domains if d.name == name), None)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.domains]

    @cached_property
    def identity(self) -> list[dict[str, Any]]:
        """What the models measure and say depends on: every domain's fields."""
        return [d.model_dump(mode="json") for d in self.domains]

    @cached_property
    def fingerprint(self) -> str:
        """The hash of ``identity``: what a model's cache key and lineage name the domains by."""
        return sha256_json(self.identity)


def domain_file(ref: str, base: Path | None = None) -> Path:
    """The file a profile's domain entry names: a bundled domain's name (``domains/<name>.yaml``),
    or a path (relative to ``base``, the project root, when not absolute)."""
    if not ref.endswith((".yaml", ".yml")) and "/" not in ref:
        return DOMAIN_DIR / f"{ref}.yaml"
    path = Path(ref).expanduser()
    return path if path.is_absolute() else (base or Path.cwd()) / path


def _format(source: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"invalid domain file {source}: {key}: {first['msg']}{more}"


def load_domain(ref: str | dict[str, Any] | Domain, base: Path | None = None) -> Domain:
    """A domain from a name, a path or an inline mapping; DomainError (one line naming the file and
    the field) when it is missing or invalid."""
    if isinstance(ref, Domain):
        return ref
    if isinstance(ref, dict):
        source, data = "(inline)", ref
    else:
        path = domain_file(str(ref), base)
        source = str(path)
        if not path.is_file():
            bundled = ", ".join(sorted(p.stem for p in DOMAIN_DIR.glob("*.yaml")))
            raise DomainError(f"domain {ref!r}: no file {path} (bundled domains: {bundled}; or give a path "
                              "to a domain file; `rde domain new NAME` writes one)")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise DomainError(f"invalid domain file {source}: not YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise DomainError(f"invalid domain file {source}: expected a mapping of fields")
    try:
        domain = Domain.model_validate(data)
    except ValidationError as exc:
        raise DomainError(_format(source, exc)) from None
    domain._source = source
    return domain


def load_domains(refs: list[Any], base: Path | None = None) -> DomainSet:
    """``load_domain`` of each entry, checked together (unique names, classes and slots)."""
    return DomainSet([load_domain(r, base) for r in refs])

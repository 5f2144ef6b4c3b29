"""What the grounded captioner measures in an image, as facts a caption may state.

Per image: the subject of the profile's domains (its type where the ImageNet classifier does not
contradict the detector), the colour names of its regions, what it carries or rides, its clothing
tone and ImageNet clothing cues (``describe_image``), plus its video track's facts
(``ImageFacts.with_track``); and the question-and-answer pairs said from those facts alone
(``facts_qa_pairs``). ``FACTS_VERSION`` enters the stage keys of a grounded generator.

Split from ``models.backends.grounded_captioner`` (the Generator that renders these facts into its
prompt) so the measuring is read apart from the prompting; the check of a reply against the facts
is ``models.backends.caption_grounding``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.backends.attributes import Attributes, measure_attributes
from models.backends.slot_layout import SlotLayout
from models.backends.track_facts import DIRECTION_PHRASES, facts_phrase, track_fact_words
from models.domains import Domain, DomainSet, Held, SubjectTypes
from models.fact_wording import fill_values, say_values
from models.prompt_files import PromptFile

FACTS_VERSION = "3"  # bump when what counts as measured changes (2: GrabCut person mask, vehicle type
# check, colours from a 0.3 share, clothing cues from probability 0.3; 3: carried objects assigned to
# the person who holds most of them, riding, clothing tone, and the track facts of image_facts)
# ImageNet classes that name clothing or carried things → the word a caption may use for them.
IMAGENET_CUES = {
    "jean": "jeans", "jersey": "jersey", "sweatshirt": "sweatshirt", "cardigan": "cardigan",
    "trench coat": "coat", "fur coat": "coat", "lab coat": "coat", "suit": "suit", "miniskirt": "skirt",
    "poncho": "poncho", "kimono": "kimono", "abaya": "abaya", "swimming trunks": "shorts", "sarong": "sarong",
    "running shoe": "sneakers", "sandal": "sandals", "cowboy boot": "boots", "backpack": "backpack",
    "umbrella": "umbrella", "sunglasses": "sunglasses", "sunglass": "sunglasses", "cowboy hat": "hat",
    "sombrero": "hat", "bonnet": "hat", "military uniform": "uniform", "bulletproof vest": "vest",
    "stole": "scarf", "mailbag": "bag", "purse": "handbag", "shopping basket": "basket",
}


@dataclass
class ImageFacts:
    """What was measured in one image: prompt lines, the words a caption may use, the values per
    fact (the subject domain's regions, type, carried and ridden objects, ``tone``, ``clothing``;
    from the video track ``motion``, ``direction``, ``distance``), and the subject's domain as
    measured."""

    lines: list[str]
    allowed: set[str]
    values: dict[str, list[str]] = field(default_factory=dict)
    domain: Domain | None = None

    def with_track(self, track: dict[str, list[str]] | None) -> ImageFacts:
        """These facts plus the image's track facts (``ChatMessage.image_facts``): a line for the
        prompt, the values (and ``movement``: the motion with its direction, "walking to the left",
        what a comparison names), and the words that state them. A motion state that is not the
        measured domain's (a person ``parked``, a vehicle ``walking``) cannot happen: it and its
        direction are dropped."""
        if not track:
            return self
        states = {s.name for s in self.domain.motion} if self.domain else set()
        track = {k: v for k, v in track.items() if k != "motion" or set(v) <= states}
        if "motion" not in track:
            track.pop("direction", None)
        phrase = facts_phrase(track)
        if not phrase:
            return self
        movement = {"movement": [" ".join([*track.get("motion", []),
                                            *(DIRECTION_PHRASES[d] for d in track.get("direction", []))])]} \
            if track.get("motion") else {}
        return ImageFacts([*self.lines, f"seen in the video: {phrase}"],
                          self.allowed | track_fact_words(track, self.domain),
                          {**self.values, **track, **movement}, self.domain)


@dataclass(frozen=True)
class FactOptions:
    """What counts as measured (the grounded captioner's ``options``): a colour covering at least
    ``min_colour_share`` of its region, an ImageNet clothing cue at ``min_cue_prob``; a detector's
    class said as a type unless the classifier contradicts it (``type_agrees``, with the domain's
    thresholds); GrabCut runs ``mask_iterations`` for the subject's pixels (0: box regions)."""

    # 0.3: faded denim measures blue 0.4–0.65 with gray 0.2–0.3 on the demo's crops; at 0.2 the pool
    # said "blue and gray bottoms" and DAP asked for "gray bottoms" that nobody there wears
    min_colour_share: float = 0.3
    # 0.3: on the demo's surveillance crops ImageNet's clothing classes never pass 0.23 and, by eye,
    # are wrong there ("abaya" for a long black coat, "bulletproof vest" for a jacket at 0.11)
    min_cue_prob: float = 0.3
    # clothing tone from the median L* of the person's pixels (0–100): on the demo's 373 person
    # crops the median is 10 (5th–95th percentile 0.4–38): vtest.avi's people wear dark coats
    dark_lightness: float = 20.0
    light_lightness: float = 60.0
    mask_iterations: int = 2


def type_agrees(detected: str, class_probs: np.ndarray, class_names: list[str], types: SubjectTypes,
                top_k: int = 10) -> bool:
    """Whether the ImageNet classifier lets the detector's class stand as the subject's type.
    Evidence for a type is the summed probability of its ImageNet classes (``types.classifier``)
    among the ``top_k``. The type stands when its own evidence is at least ``types.support``, or
    when no other type (or "other") reaches ``types.contradiction``. On the demo's 1906 film the
    COCO detector calls old cars motorcycles and horse carts cars; the classifier's top classes
    there are Model T, garbage truck or horse cart, never moped or cab, so those types are left
    unsaid."""
    evidence: dict[str, float] = {}
    for i in np.argsort(-class_probs)[:top_k]:
        kind = types.classifier.get(class_names[i])
        if kind:
            evidence[kind] = evidence.get(kind, 0.0) + float(class_probs[i])
    if evidence.get(detected, 0.0) >= types.support:
        return True
    return max((v for k, v in evidence.items() if k != detected), default=0.0) < types.contradiction


def always_allowed(domains: DomainSet) -> set[str]:
    """Words any caption may use: every domain's ``subject.allowed`` (they state no attribute)."""
    return {w for d in domains for w in d.subject.allowed}


def _held_facts(spec: Held, attrs: Attributes) -> tuple[list[str], list[str], set[str]]:
    """Lines, values and allowed words of one carried or ridden declaration (objects detected at a
    score of at least 0.3)."""
    found = attrs.top(spec.slot, 0.3)[:spec.at_most]
    if not found and spec.none is None:
        return [], [], set()
    line = f"{spec.line}: {spec.value.format(items=', '.join(found)) if found else spec.none}"
    words = {w for item in spec.items if item.label in found for w in item.words}
    return [line], found, set(found) | words | (set(spec.verbs) if found else set())


def describe_image(image: np.ndarray, detections, class_probs: np.ndarray, class_names: list[str],
                   layout: SlotLayout, options: FactOptions = FactOptions()) -> ImageFacts:
    """Facts about one image in its subject domain's terms: the subject (its type, where the domain
    has types and the classifier does not contradict it: else the domain's noun), its regions'
    colours, what it carries and rides, its clothing tone, ImageNet clothing cues, the image size."""
    attrs = measure_attributes(image, detections, layout, mask_iterations=options.mask_iterations)
    domain = layout.domains[attrs.top("domain")[0]]
    subject = domain.subject
    allowed = always_allowed(layout.domains) | {subject.noun}
    lines: list[str] = []
    values: dict[str, list[str]] = {}
    h, w = image.shape[:2]
    if subject.types is not None:
        kind = [t for t in attrs.top(subject.types.slot)[:1]
                if type_agrees(t, class_probs, class_names, subject.types)]
        values[subject.types.fact] = kind
        lines.append(f"subject: a {(kind or [subject.noun])[0]}")
        allowed |= set(kind) | {word for word, k in subject.types.words.items() if k in kind}
    else:
        detected = any(label in subject.classes for label in detections.labels)
        lines.append(f"subject: a {subject.noun}" if detected or subject.missing is None
                     else f"subject: {subject.missing}")
    for region in domain.regions:
        colours = attrs.top(region.slot, options.min_colour_share)[:region.colours]
        lines.append(f"{region.line}: {', '.join(colours) or 'unclear'}")
        values[region.fact] = colours
        allowed |= set(colours)
    for spec in (domain.carried, domain.ridden):
        if spec is not None:
            held_lines, found, words = _held_facts(spec, attrs)
            lines += held_lines
            if held_lines:
                values[spec.fact] = found
            allowed |= words
    tone = [] if attrs.lightness is None else ["dark"] if attrs.lightness <= options.dark_lightness else \
        ["light"] if attrs.lightness >= options.light_lightness else []
    if tone:
        lines.append(f"clothing tone: {tone[0]}")
        values["tone"] = tone
        allowed |= set(tone)
    cues = sorted({IMAGENET_CUES[class_names[i]] for i in np.argsort(-class_probs)[:10]
                   if class_probs[i] >= options.min_cue_prob and class_names[i] in IMAGENET_CUES})
    if cues:
        lines.append(f"clothing cues: {', '.join(cues)}")
        allowed |= set(cues)
    values["clothing"] = cues
    lines.append(f"image size: {w}x{h} pixels")
    return ImageFacts(lines, allowed, values, domain)


def facts_qa_pairs(facts: list[ImageFacts], prompt: PromptFile) -> list[tuple[str, str]]:
    """Question-and-answer pairs rendered from measured facts (``qa_single`` / ``qa_compare`` in the
    prompt file): one image → one pair per measured attribute; two images (target, reference) → a
    similarity or difference pair per attribute measured in both. Unmeasured attributes are skipped,
    as the GTR+ prompts ask ("if any attribute is not clearly visible, ignore it"). The measured
    domain's ``questions`` and ``comparisons`` come first, then the file's (the track facts'). A
    value is said through the file's ``phrases`` ("left" → "to the left"), ``{subject}`` as the
    measured domain's ``subject.said_as`` ("the person"); an answer may name other attributes
    (``{direction}``) and be a list, the first whose attributes were all measured is said ("The
    person is walking to the left.", else "The person is walking."); an entry is skipped when every
    attribute in its ``unless`` was measured (their answers already say it)."""
    domain = facts[0].domain
    single = {**(domain.questions if domain else {}), **prompt.extras.get("qa_single", {})}
    compare = {**(domain.comparisons if domain else {}), **prompt.extras.get("qa_compare", {})}
    phrases: dict[str, dict[str, str]] = prompt.extras.get("phrases", {})

    pairs: list[tuple[str, str]] = []
    if len(facts) == 1:
        subject = domain.subject.said_as if domain else "it"
        values = facts[0].values
        for attribute, spec in single.items():
            unless = spec.get("unless", [])
            if not values.get(attribute) or (unless and all(values.get(other) for other in unless)):
                continue  # not measured, or what the answer says is said by the others' answers
            for answer in [spec["a"]] if isinstance(spec["a"], str) else spec["a"]:
                text = fill_values(answer.replace("{subject}", subject), values, phrases, attribute)
                if text is not None:
                    pairs.append((spec["q"].format(subject=subject), _capitalised(text)))
                    break
        return pairs
    target, reference = facts[0].values, facts[1].values
    for attribute, spec in compare.items():
        a, b = target.get(attribute) or [], reference.get(attribute) or []
        if not a or not b:
            continue
        if set(a) & set(b):
            pairs.append((spec["similar_q"], spec["similar_a"].format(
                value=say_values(attribute, sorted(set(a) & set(b)), phrases))))
        if set(a) != set(b):
            pairs.append((spec["differ_q"], spec["differ_a"].format(target=say_values(attribute, a, phrases),
                                                                     reference=say_values(attribute, b, phrases))))
    return pairs


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]

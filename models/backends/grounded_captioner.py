"""A captioning Generator for the CPU built from real models that cannot see in words by themselves.

Per attached image it measures facts (the subject of the profile's domains and what it carries or
rides, colour names of its regions, its type, ImageNet clothing cues), renders them into the system prompt (a versioned
file in ``prompts/``) and lets a small text LLM answer the request. The answer is then checked:
any sentence that names a colour, garment, object, vehicle type, gender, age or accessory that
was not measured is removed, together with its tokens' log-probabilities. If nothing is left the
result is an error ("ungrounded"), which the stage keeps as a rejected row. The captioner
therefore never states an attribute that was not measured.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from models.backends.attributes import COLOUR_SYNONYMS, Attributes, measure_attributes
from models.backends.content_memo import image_digest
from models.backends.detectors import Detector
from models.backends.image_embedders import EfficientNetLiteEmbedder
from models.backends.interfaces import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    Generator,
    TokenLogprob,
    parallel_requests,
    score_texts,
)
from models.backends.slot_layout import SlotLayout, slot_layout
from models.backends.track_facts import DIRECTION_PHRASES, facts_phrase, track_claim_words, track_fact_words
from models.domains import Domain, DomainSet, Held, SubjectTypes
from models.fact_wording import fill_values, say_values
from models.prompt_files import PromptFile, load_prompt
from models.specs import ModelSpec

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
GENDER_AGE = {"man", "woman", "men", "women", "boy", "girl", "he", "she", "his", "her", "him", "male", "female",
              "lady", "gentleman", "guy", "young", "old", "elderly", "child", "kid", "teenager", "adult", "senior"}
ACCESSORIES = {"hair", "hat", "cap", "glasses", "sunglasses", "beard", "scarf", "helmet", "mask", "gloves", "watch",
               "earrings", "necklace", "tie", "belt", "shoes", "sneakers", "boots", "sandals", "heels"}
# ImageNet cue words for garments (claims like the domains' region words)
CUE_GARMENTS = {"poncho", "kimono", "abaya", "sarong", "uniform"}
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)?")
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]?")


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


@lru_cache(maxsize=16)
def claim_words(domains: DomainSet) -> frozenset[str]:
    """Words that claim an attribute and so must have been measured: the domains' region, covering,
    type and held-object words (less those any caption may use), ImageNet garment cues, gender,
    age, accessories and the track facts' words. Colour words are claims too (``_attribute_words``)."""
    worded = {w for d in domains for r in d.regions for w in r.words} | CUE_GARMENTS
    worded |= {w for d in domains for w in d.appearance.whole_words}
    held = {w for d in domains for h in (d.carried, d.ridden) if h for item in h.items for w in item.words}
    types = {w for d in domains if d.subject.types for w in d.subject.types.words}
    return frozenset((worded - always_allowed(domains)) | held | types | GENDER_AGE | ACCESSORIES
                     | track_claim_words(domains))


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


def _attribute_words(words: set[str], claims: frozenset[str]) -> set[str]:
    """The subset of ``words`` that makes an attribute claim (and so must have been measured)."""
    colours = {w for w in words if w in COLOUR_SYNONYMS and COLOUR_SYNONYMS[w] is not None}
    return colours | (words & claims)


def ungrounded_words(sentence: str, allowed: set[str], claims: frozenset[str]) -> set[str]:
    """Attribute words (``claims``, ``claim_words``) in ``sentence`` that the facts do not contain
    (synonyms count as the same colour)."""
    words = set(_WORD.findall(sentence.lower()))
    allowed_colours = {COLOUR_SYNONYMS[a] for a in allowed if COLOUR_SYNONYMS.get(a)}
    bad = set()
    for word in _attribute_words(words, claims):
        if word in allowed:
            continue
        if word in COLOUR_SYNONYMS and COLOUR_SYNONYMS[word] in allowed_colours:
            continue
        bad.add(word)
    return bad


_PRONOUNS = [(re.compile(r"\b(she|he)\b", re.I), "the person"), (re.compile(r"\b(her|his)\b", re.I), "their"),
             (re.compile(r"\bhim\b", re.I), "them")]
_CLAUSE = re.compile(r",|;|\s+(?:with|and|while|but)\s+")


def neutralise_pronouns(text: str) -> str:
    """Gendered pronouns → neutral ones (gender is never measured): a grounding edit, not a claim."""
    for pattern, replacement in _PRONOUNS:
        text = pattern.sub(lambda m, r=replacement: r.capitalize() if m.group(0)[0].isupper() else r, text)
    return text


def _clause_spans(sentence: str, offset: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    for match in _CLAUSE.finditer(sentence):
        spans.append((offset + start, offset + match.start()))
        start = match.start()
    spans.append((offset + start, offset + len(sentence)))
    return spans


def keep_grounded(result: GenerationResult, allowed: set[str],
                  claims: frozenset[str]) -> tuple[str, list[TokenLogprob], list[str]]:
    """Remove what the facts do not support; keep the log-probabilities of the kept tokens.

    Pronouns are neutralised first. Then, per sentence, each clause (split at commas, semicolons,
    "with", "and", "while", "but") that names an unmeasured attribute is removed; if the first
    (main) clause is ungrounded the whole sentence goes. Tokens are kept when they start inside a
    kept span of the original text, so q_txt is computed over what is actually kept.
    """
    original = result.text
    spans, dropped = [], []
    for match in _SENTENCE.finditer(original):
        sentence = match.group(0)
        if not sentence.strip():
            continue
        clauses = _clause_spans(sentence, match.start())
        verdicts = [ungrounded_words(neutralise_pronouns(original[a:b]), allowed, claims) for a, b in clauses]
        if verdicts[0]:
            dropped.append(f"{sentence.strip()[:80]!r}: {sorted(verdicts[0])}")
            continue
        for (a, b), bad in zip(clauses, verdicts, strict=True):
            if bad:
                dropped.append(f"{original[a:b].strip()[:60]!r}: {sorted(bad)}")
            else:
                spans.append((a, b))
    pieces: list[str] = []
    prev_end = -1
    for a, b in spans:
        if pieces and a == prev_end:  # the clause continues the previous kept one
            pieces[-1] += original[a:b]
        else:
            pieces.append(original[a:b].strip())
        prev_end = b
    kept = ""
    for piece in (p.strip() for p in pieces if re.search(r"\w", p)):
        kept = piece if not kept else kept + ("" if piece[0] in ",;" else " ") + piece
    kept = kept.rstrip(",;")
    if kept and kept[-1] not in ".!?":
        kept += "."
    kept = neutralise_pronouns(kept)
    tokens, pos = [], 0
    for tok in result.tokens:
        start = original.find(tok.token, pos) if tok.token else pos
        start = pos if start < 0 else start
        pos = start + len(tok.token)
        if any(a <= start < b for a, b in spans):
            tokens.append(tok)
    return kept, tokens, dropped


class GroundedCaptionGenerator:
    """Measured facts + a text LLM = a Generator that takes images and never invents attributes.

    ``model_id`` names the composition; ``llm`` is any text Generator (SmolLM2 through llama.cpp
    offline). Options: the fields of ``FactOptions``, ``qa_from_facts`` (true), ``facts_memo`` (4096),
    ``facts_threads`` (2: how many requests' facts are measured at once before the LLM runs; speed
    only, see ``_measure_ahead``).
    """

    def __init__(self, spec: ModelSpec, detector: Detector, embedder: EfficientNetLiteEmbedder,
                 llm: Generator, domains: DomainSet, prompt: PromptFile | None = None) -> None:
        self.spec = spec
        self.layout = slot_layout(domains)
        self.claims = claim_words(domains)
        self.detector, self.embedder, self.llm = detector, embedder, llm
        self.prompt = prompt or load_prompt("grounded_captioner")
        self.model_id = f"{spec.model_id}[{llm.model_id}]"
        self.parallel_requests = parallel_requests(llm)
        defaults = FactOptions()
        self.fact_options = FactOptions(**{name: type(getattr(defaults, name))(spec.options[name])
                                           for name in defaults.__dataclass_fields__ if name in spec.options})
        self.qa_from_facts = bool(spec.options.get("qa_from_facts", True))
        self.memo_size = int(spec.options.get("facts_memo", 4096))
        self.facts_threads = max(1, int(spec.options.get("facts_threads", 2)))
        self._facts_memo: dict[bytes, ImageFacts] = {}
        self._facts_lock = threading.Lock()  # _measure_ahead's threads share the memo

    def facts(self, images: list[np.ndarray]) -> list[ImageFacts]:
        if not images:
            return []
        detections = self.detector.detect(images)
        probs = self.embedder.class_probabilities(images)
        return [describe_image(im, d, p, self.embedder.class_names, self.layout, self.fact_options)
                for im, d, p in zip(images, detections, probs, strict=True)]

    def _facts_qa(self, request: GenerationRequest, facts: list[ImageFacts]) -> GenerationResult:
        """A ``qa_pairs`` request answered from the measured facts (no LLM; no token probabilities)."""
        pairs = facts_qa_pairs(facts[:2], self.prompt)
        if not pairs:
            return GenerationResult(request.request_id, "", [], self.model_id, "stop",
                                    "ungrounded: no attribute was measured to ask about")
        text = "\n".join(f"Q{i}: {q}\nA{i}: {a}" for i, (q, a) in enumerate(pairs, 1))
        return GenerationResult(request.request_id, text, [], self.model_id, "stop")

    def ground_request(self, request: GenerationRequest) -> tuple[GenerationRequest, set[str]] | None:
        """The text-only request the LLM gets for ``request`` (the measured facts of its images in
        the system prompt, the images dropped) and the words a reply may use; None when the request
        is answered from the facts without the LLM (a ``qa_pairs`` request with ``qa_from_facts``)."""
        facts = self.request_facts(request)
        if request.expects == "qa_pairs" and self.qa_from_facts and facts:
            return None
        roles = ["target"] + ["reference"] * (len(facts) - 1)
        block = "\n".join(self.prompt.render("image_facts", index=i + 1, role=roles[i], lines="; ".join(f.lines))
                          for i, f in enumerate(facts)) or "No image was given."
        system = ChatMessage("system", self.prompt.render("system", facts=block))
        rest = [ChatMessage(m.role, m.content) for m in request.messages if m.role != "system"]
        extra_system = [m.content for m in request.messages if m.role == "system"]
        if extra_system:
            system.content += "\n" + "\n".join(extra_system)
        allowed = set().union(*(f.allowed for f in facts)) if facts else always_allowed(self.layout.domains)
        return GenerationRequest(request.request_id, [system, *rest], request.max_tokens, request.temperature,
                                 request.seed), allowed

    def _measure_ahead(self, requests: list[GenerationRequest]) -> None:
        """Measure every request's facts before the loop that builds the LLM's requests, one request
        per call on ``facts_threads`` threads (GrabCut and the NumPy work release the GIL; the
        detector has its own lock). The calls are the ones ``ground_request`` makes, each with one
        request's images, so every fact, and every EfficientNet row the memo keeps for later stages,
        equals the sequential path's: checked exactly on the demo's crops
        (test_measured_ahead_facts_equal_sequential). On the demo's 80 crops per domain, 2.5–3.0 s
        become 1.4–1.5 s; the LLM's contexts are idle meanwhile."""
        groups = [[im for m in r.messages for im in m.images] for r in requests]
        groups = [g for g in groups if g]
        if self.facts_threads < 2 or len(groups) < 2:
            return
        with ThreadPoolExecutor(max_workers=min(self.facts_threads, len(groups))) as pool:
            list(pool.map(self._facts_cached, groups))

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self._measure_ahead(requests)
        grounded: list[GenerationRequest] = []
        allowed_sets: list[set[str]] = []
        answered: dict[str, GenerationResult] = {}
        for request in requests:
            built = self.ground_request(request)
            if built is None:
                answered[request.request_id] = self._facts_qa(request, self.request_facts(request))
                continue
            grounded.append(built[0])
            allowed_sets.append(built[1])
        results = []
        for result, allowed in zip(self.llm.generate(grounded) if grounded else [], allowed_sets, strict=True):
            if not result.ok:
                results.append(GenerationResult(result.request_id, "", [], self.model_id, result.finish_reason,
                                                result.error, result.attempts))
                continue
            text, tokens, dropped = keep_grounded(result, allowed, self.claims)
            error = None if text else "ungrounded: every sentence stated something not measured (" + \
                "; ".join(dropped)[:300] + ")"
            results.append(GenerationResult(result.request_id, text, tokens if text else [], self.model_id,
                                            result.finish_reason, error, result.attempts))
        by_id = {r.request_id: r for r in results} | answered
        return [by_id[r.request_id] for r in requests]

    def score(self, requests: list[GenerationRequest], texts: list[str]) -> list[GenerationResult]:
        """Teacher forcing (q_txt of a given text, GTR+ Eq. 8): each text as the LLM's reply to the
        same grounded request ``generate`` sends (``ground_request``: same facts, same prompt), scored
        by the LLM's ``score``. No grounding filter runs: the text is given, every token of it counts;
        the end-of-turn token after it (empty text) is left out, as ``generate``'s q_txt leaves it out
        (``keep_grounded`` keeps tokens that start inside the kept text), so both are on one scale. A
        request answered from the facts (Q&A) has no token probabilities: its result is an error.
        NotImplementedError when the LLM backend cannot teacher-force."""
        built = [self.ground_request(r) for r in requests]
        todo = [(i, b[0], t) for i, (b, t) in enumerate(zip(built, texts, strict=True)) if b is not None]
        scored = score_texts(self.llm, [r for _, r, _ in todo], [t for _, _, t in todo]) if todo else []
        out = [GenerationResult(r.request_id, "", [], self.model_id, None,
                                "unsupported: a Q&A request is answered from the facts, without token probabilities")
               for r in requests]
        for (i, _, _), res in zip(todo, scored, strict=True):
            tokens = res.tokens[:-1] if res.tokens and not res.tokens[-1].token else res.tokens
            out[i] = GenerationResult(res.request_id, res.text, tokens, self.model_id, res.finish_reason,
                                      res.error, res.attempts)
        return out

    def measured_facts(self, images: list[np.ndarray],
                       image_facts: list[dict[str, list[str]]] | None = None) -> list[ImageFacts]:
        """What was measured in each image (remembered from ``generate``), with its track facts
        when given: the caption pool checks kept captions against it."""
        track = image_facts or [{}] * len(images)
        return [f.with_track(t) for f, t in zip(self._facts_cached(images), track, strict=True)]

    def request_facts(self, request: GenerationRequest) -> list[ImageFacts]:
        """The facts of a request's images in order: measured in the pixels, plus each message's
        ``image_facts`` (one per image, or none)."""
        images = [im for m in request.messages for im in m.images]
        track = [t for m in request.messages
                 for t in (m.image_facts if len(m.image_facts) == len(m.images) else [{}] * len(m.images))]
        return self.measured_facts(images, track)

    def _facts_cached(self, images: list[np.ndarray]) -> list[ImageFacts]:
        """Facts per image, remembered by content (the tiers ask about the same image several times)."""
        keys = [image_digest(im) for im in images]
        with self._facts_lock:
            found = {k: self._facts_memo[k] for k in keys if k in self._facts_memo}
        missing = [i for i, k in enumerate(keys) if k not in found]
        if missing:
            computed = self.facts([images[i] for i in missing])
            with self._facts_lock:
                for i, f in zip(missing, computed, strict=True):
                    self._facts_memo[keys[i]] = found[keys[i]] = f
                while len(self._facts_memo) > self.memo_size:
                    self._facts_memo.pop(next(iter(self._facts_memo)))
        return [found[k] for k in keys]

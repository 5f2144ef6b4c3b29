"""A captioning Generator for the CPU built from real models that cannot see in words by themselves.

Per attached image it measures facts (the subject of the profile's domains and what it carries or
rides, colour names of its regions, its type, ImageNet clothing cues), renders them into the system prompt (a versioned
file in ``prompts/``) and lets a small text LLM answer the request. The answer is then checked:
any sentence that names a colour, garment, object, vehicle type, gender, age or accessory that
was not measured is removed, together with its tokens' log-probabilities. If nothing is left the
result is an error ("ungrounded"), which the stage keeps as a rejected row. The captioner
therefore never states an attribute that was not measured.

The facts are measured in ``models.backends.measured_facts`` and the reply is checked in
``models.backends.caption_grounding``; this module holds the Generator that joins them to the LLM.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from models.backends.caption_grounding import claim_words, keep_grounded
from models.backends.content_memo import image_digest
from models.backends.detectors import Detector
from models.backends.image_embedders import EfficientNetLiteEmbedder
from models.backends.interfaces import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    Generator,
    parallel_requests,
    score_texts,
)
from models.backends.measured_facts import FactOptions, ImageFacts, always_allowed, describe_image, facts_qa_pairs
from models.backends.slot_layout import slot_layout
from models.domains import DomainSet
from models.prompt_files import PromptFile, load_prompt
from models.specs import ModelSpec


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

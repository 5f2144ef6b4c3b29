"""GTR+ tiered description generation (paper Sec. 3.1) for one shard of images.

- Base tier (Fig. 4): the generator asks and answers its own questions about the person
  (``base_qa``), then a sum-instruction turns the Q&A pairs into T_base (``base_sum``).
- Intermediate tier (Fig. 5): target + hard-negative image, comparison Q&A (``inter_qa``), then a
  revised sum-instruction about the target only → T_inter (``inter_sum``).
- Advanced tier (Sec. 3.1.3): a template drawn from the gallery, T_base + T_inter and the image
  → T_adv (``adv``). Needs both earlier tiers of the image; otherwise the row is rejected with
  ``missing_tier_input`` (the paper builds T_adv from both).

q_txt (Eq. 8) is the mean token probability of the summarising call, i.e. of the caption itself;
boilerplate stripping afterwards does not change it. Every (image, tier) ends as a caption row or
a rejected row with a reason code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, Generator
from models.domains import DomainSet
from models.prompt_files import PromptFile
from rde.common.generation_retries import error_reason, generate_with_retries
from rde.common.reasons import rejected_row
from rde.common.seeds import draw_seed
from rde.largefine.caption_quality import gate_caption, word_count
from rde.largefine.config import LargeFineSpec
from rde.largefine.qa_pairs import QAPair, format_qa_pairs, parse_qa_pairs
from rde.largefine.template_gallery import Gallery

TIERS = ("base", "inter", "adv")


@dataclass
class TierImage:
    """One image to caption, its hard negative (if any) and the generator assigned to it."""

    image_id: str
    source: str
    domain: str
    image: np.ndarray
    generator_index: int
    negative_id: str | None = None
    negative_image: np.ndarray | None = None
    facts: dict[str, list[str]] = field(default_factory=dict)  # the image's video-track facts
    negative_facts: dict[str, list[str]] = field(default_factory=dict)  # the hard negative's


@dataclass
class TierOutputs:
    """Rows produced for a shard, plus what the generator calls cost (for throughput tables)."""

    captions: list[dict[str, Any]] = field(default_factory=list)
    qa: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    requested: int = 0  # (image, tier) captions asked for: the input, counted before any call
    generator_calls: int = 0
    generated_tokens: int = 0
    generator_seconds: float = 0.0

    def stats(self, images: int) -> dict[str, Any]:
        """Counts of a shard: input is the (image, tier) captions asked for, so a caption neither
        accepted nor rejected shows as a gap (the runner's balance check)."""
        rejected: dict[str, int] = {}
        for row in self.rejects:
            rejected[row["reason"]] = rejected.get(row["reason"], 0) + 1
        return {"input_rows": self.requested, "accepted": len(self.captions),
                "rejected": rejected, "images": images, "generator_calls": self.generator_calls,
                "generated_tokens": self.generated_tokens, "generator_seconds": round(self.generator_seconds, 3)}


def assign_generator(seed: int, image_id: str, n_generators: int) -> int:
    """Which of the profile's generators captions this image (uniform, recorded in the row)."""
    return draw_seed(seed, image_id + "#generator") % n_generators


class TierCaptioner:
    """Runs the tiers over a batch of images with the profile's generators (one per image)."""

    def __init__(self, generators: Sequence[Generator], prompt: PromptFile, spec: LargeFineSpec,
                 domains: DomainSet | None = None) -> None:
        if not generators:
            raise ValueError("build-largefine needs at least one entry in models.generators")
        self.generators, self.prompt, self.spec, self.domains = list(generators), prompt, spec, domains
        self.attributes = ", ".join(prompt.extras.get("attributes", []))

    def wording(self, item: TierImage) -> dict[str, str]:
        """The tier prompt's words for ``item``'s subject: its domain's ({subject}, {noun}, {nouns},
        {attributes}), else the prompt file's ``wording`` (written for people)."""
        domain = self.domains.get(item.domain) if self.domains is not None else None
        if domain is None:
            return {"attributes": self.attributes, **self.prompt.extras.get("wording", {})}
        return {"subject": domain.subject.said_as, "noun": domain.subject.noun, "nouns": domain.subject.plural_noun,
                "attributes": ", ".join(domain.captions.attributes) or self.attributes}

    # -- generator calls ---------------------------------------------------------------------------

    def _generate(self, jobs: list[tuple[TierImage, GenerationRequest]], out: TierOutputs) -> list[GenerationResult]:
        """Each request on its image's generator (batched per generator), with bounded retries."""
        results: dict[str, GenerationResult] = {}
        for index, generator in enumerate(self.generators):
            mine = [request for item, request in jobs if item.generator_index == index]
            if not mine:
                continue
            start = time.perf_counter()
            answered = generate_with_retries(generator, mine, self.spec.retries.max_attempts,
                                             self.spec.retries.backoff_s)
            out.generator_seconds += time.perf_counter() - start
            out.generator_calls += sum(r.attempts for r in answered)
            out.generated_tokens += sum(len(r.tokens) for r in answered)
            results.update((r.request_id, r) for r in answered)
        return [results[request.request_id] for _, request in jobs]

    def _request(self, item: TierImage, tier: str, step: str, text: str, images: list[np.ndarray],
                 max_tokens: int) -> GenerationRequest:
        """One generator call about ``images`` (the image, then its hard negative), each with its
        video-track facts (``ChatMessage.image_facts``)."""
        facts = [item.facts, item.negative_facts][:len(images)]
        return GenerationRequest(f"{item.image_id}:{tier}:{step}", [ChatMessage("user", text, images, facts)],
                                 max_tokens=max_tokens, temperature=self.spec.temperature,
                                 seed=draw_seed(self.spec.seed, f"{item.image_id}#{tier}#{step}") % 2**31,
                                 expects="qa_pairs" if step == "qa" else None)

    # -- rows ----------------------------------------------------------------------------------------

    def _reject(self, out: TierOutputs, item: TierImage, tier: str, reason: str, text: str | None,
                detail: str) -> None:
        generator = self.generators[item.generator_index].model_id
        out.rejects.append(rejected_row(item.image_id, f"tier-{tier}", reason, kind="caption", domain=item.domain,
                                        image_id=item.image_id, source=item.source, text=text,
                                        detail=f"{detail} [generator {generator}]"[:2000]))

    def _accept(self, out: TierOutputs, item: TierImage, tier: str, result: GenerationResult, prompt_step: str,
                template_id: str | None = None, gallery: str | None = None) -> bool:
        if not result.ok:
            self._reject(out, item, tier, error_reason(result.error), None, result.error or "")
            return False
        s = self.spec
        gate = gate_caption(result.text, min_words=s.min_words, max_words=s.max_words, boilerplate=s.boilerplate,
                            max_repeated_sentence_share=s.max_repeated_sentence_share,
                            negative_mentions=s.negative_mentions if tier != "base" else (),
                            drop_repeats=s.drop_repeated_sentences)
        if gate.reason is not None:
            self._reject(out, item, tier, gate.reason, gate.text, gate.detail)
            return False
        out.captions.append({
            "image_id": item.image_id, "source": item.source, "domain": item.domain, "tier": tier,
            "text": gate.text, "raw_text": result.text, "cleaning": list(gate.cleaning),
            "q_txt": result.mean_token_probability, "words": word_count(gate.text),
            "generator": result.model_id, "generator_index": item.generator_index,
            "prompt": f"{self.prompt.identity}:{prompt_step}", "template_id": template_id, "gallery": gallery,
            "hard_negative_id": item.negative_id if tier != "base" else None,
        })
        return True

    # -- tiers ---------------------------------------------------------------------------------------

    def qa_tier(self, items: Sequence[TierImage], tier: str, out: TierOutputs) -> dict[str, str]:
        """Base (``tier='base'``) or intermediate (``'inter'``) tier: Q&A, then summary.
        Returns the accepted texts by image id."""
        if tier not in ("base", "inter"):
            raise ValueError(f"qa_tier handles base and inter, not {tier!r}")
        s = self.spec
        out.requested += len(items)
        runnable: list[TierImage] = []
        for item in items:
            if tier == "inter" and (item.negative_id is None or item.negative_image is None):
                self._reject(out, item, tier, "no_hard_negative", None, "the pool holds no other distinct image")
            else:
                runnable.append(item)
        images = {item.image_id: [item.image] if tier == "base" else [item.image, item.negative_image]
                  for item in runnable}
        qa_jobs = [(item, self._request(item, tier, "qa", self.prompt.render(f"{tier}_qa", **self.wording(item)),
                                        images[item.image_id], s.qa_max_tokens)) for item in runnable]
        pairs_by_image: dict[str, list[QAPair]] = {}
        for (item, _), result in zip(qa_jobs, self._generate(qa_jobs, out), strict=True):
            if not result.ok:
                self._reject(out, item, tier, error_reason(result.error), None, result.error or "")
                continue
            pairs = parse_qa_pairs(result.text)
            if len(pairs) < s.min_qa_pairs:
                self._reject(out, item, tier, "malformed_qa", result.text,
                             f"{len(pairs)} distinct answered Q&A pairs < {s.min_qa_pairs}")
                continue
            pairs_by_image[item.image_id] = pairs
            out.qa.extend({"image_id": item.image_id, "tier": tier, "pair_index": i, "question": p.question,
                           "answer": p.answer, "generator": result.model_id} for i, p in enumerate(pairs))
        sum_jobs = [(item, self._request(item, tier, "sum", self.prompt.render(
            f"{tier}_sum", **self.wording(item), qa=format_qa_pairs(pairs_by_image[item.image_id]),
            answers=" ".join(p.answer for p in pairs_by_image[item.image_id])), images[item.image_id],
            s.summary_max_tokens)) for item in runnable if item.image_id in pairs_by_image]
        accepted: dict[str, str] = {}
        for (item, _), result in zip(sum_jobs, self._generate(sum_jobs, out), strict=True):
            if self._accept(out, item, tier, result, f"{tier}_qa+{tier}_sum"):
                accepted[item.image_id] = out.captions[-1]["text"]
        return accepted

    def advanced_tier(self, items: Sequence[TierImage], base: dict[str, str], inter: dict[str, str],
                      gallery: Gallery, out: TierOutputs) -> None:
        """T_adv from a randomly drawn template (seeded per image) and the image's T_base + T_inter."""
        jobs, chosen = [], {}
        out.requested += len(items)
        for item in items:
            missing = [name for name, texts in (("base", base), ("inter", inter)) if item.image_id not in texts]
            if missing:
                self._reject(out, item, "adv", "missing_tier_input", None,
                             f"no accepted T_{' or T_'.join(missing)} for this image")
                continue
            if not gallery.templates:
                self._reject(out, item, "adv", "no_template", None, "the template gallery is empty")
                continue
            template = gallery.choose(draw_seed(self.spec.seed, item.image_id + "#template"))
            chosen[item.image_id] = template
            text = self.prompt.render("adv", **self.wording(item), template=template.text, base=base[item.image_id],
                                      inter=inter[item.image_id])
            jobs.append((item, self._request(item, "adv", "adv", text, [item.image], self.spec.summary_max_tokens)))
        for (item, _), result in zip(jobs, self._generate(jobs, out), strict=True):
            self._accept(out, item, "adv", result, "adv", chosen[item.image_id].template_id, gallery.version)

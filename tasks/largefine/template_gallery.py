"""The template-gallery stage: the advanced tier's stylized templates (seeds + extract-and-expand)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from models.backends.registry import BUNDLED_LLM
from models.domains import Domain
from models.prompt_files import PromptFile, load_prompt
from models.specs import ModelSpec
from rde.common.reasons import rejected_row
from rde.largefine.template_gallery import build_gallery
from storage.hashing import sha256_json
from storage.schemas import REJECTS, TEMPLATES
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Stage, StageRun, Work, Write

GALLERY_PROMPT = "gtr_template_gallery"
# what the tier stages' texts depend on (the ``largefine`` fields in their keys)


@dataclass(frozen=True)
class GalleryPrompt:
    """What ``lineage`` loaded: the gallery prompt and the template generator."""

    prompt: Any
    generator: ModelSpec


def domain_gallery_prompt(prompt: PromptFile, captioned: list[Domain]) -> PromptFile:
    """The gallery prompt for the captioned domains: where they declare ``templates``, their slots,
    seeds and subject words (merged, in domain order) replace the file's, which are written for
    people; ``measurable_slots`` then comes from them too, not from the profile."""
    declared = [(d, d.templates) for d in captioned if d.templates is not None]
    if not declared:
        return prompt
    extras = dict(prompt.extras)
    templates = [t for _, t in declared]
    extras["slots"] = list(dict.fromkeys(s for t in templates for s in t.slots))
    extras["seeds"] = list(dict.fromkeys(s for t in templates for s in t.seeds))
    rules = dict(extras.get("caption_pattern") or {})
    if rules:
        rules["person_slot"] = templates[0].subject_slot
        rules["stand_ins"] = {**rules.get("stand_ins", {}), **{t.subject_slot: d.subject.noun for d, t in declared},
                              **{k: v for t in templates for k, v in t.stand_ins.items()}}
        rules["person_words"] = list(dict.fromkeys([*rules.get("person_words", []),
                                                    *(w for d, _ in declared for w in d.subject.nouns),
                                                    *(w for t in templates for w in t.subject_words)]))
        extras["caption_pattern"] = rules
    measurable = [t.measurable for t in templates]
    extras["measurable_slots"] = None if any(m is None for m in measurable) else \
        list(dict.fromkeys(s for m in measurable for s in m or []))
    digest = sha256_json([prompt.sha256, [t.model_dump(mode="json") for t in templates]])
    return PromptFile(prompt.name, prompt.version, digest, prompt.templates, extras)


class TemplateGallery(Stage):
    """The advanced tier's template gallery: seeds + extract-and-expand over sampled tier-1/2
    captions with the profile's text generator; rejected candidates kept with reasons."""

    name = "template-gallery"
    version = "3"  # 3: measurable_slots
    reads = ("tier12_captions",)
    writes = (Write("template_gallery", "templates", TEMPLATES),
              Write("template_rejects", "rejects", REJECTS, rejects=True))
    config = ("largefine.templates", "largefine.domains", "domains")
    prepares = GalleryPrompt
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        prompt = domain_gallery_prompt(load_prompt(GALLERY_PROMPT),
                                       [run.domains[n] for n in run.section("largefine").domains])
        gen_spec = run.models.template_generator or ModelSpec(**BUNDLED_LLM)
        run.prepared = GalleryPrompt(prompt, gen_spec)
        return Lineage(models={"template_generator": run.registry().lineage(gen_spec)},
                       prompts={GALLERY_PROMPT: prompt.identity})

    def run(self, run: StageRun) -> Work:
        spec = run.section("largefine").templates
        texts = [r["text"] for r in run.input("tier12_captions").rows(["text"])]
        rng = np.random.default_rng(spec.seed)
        sample = [texts[i] for i in sorted(rng.choice(len(texts), size=min(spec.sample_captions, len(texts)),
                                                      replace=False))] if texts else []
        prepared: GalleryPrompt = run.prepared
        generator = run.registry().generator(prepared.generator)
        gallery = build_gallery(generator.generate, sample, prepared.prompt,
                                captions_per_request=spec.captions_per_request, rounds=spec.rounds,
                                max_templates=spec.max_templates, min_words=spec.min_words, max_words=spec.max_words,
                                max_tokens=spec.max_tokens, temperature=spec.temperature, seed=spec.seed,
                                measurable_slots=prepared.prompt.extras.get("measurable_slots", spec.measurable_slots))
        rows = [{"template_id": t.template_id, "text": t.text, "slots": list(t.slots), "origin": t.origin,
                 "round": t.round} for t in gallery.templates]
        rejects = [rejected_row(f"round-{r.round}", f"template-{r.origin}", r.reason, kind="template",
                                domain="template", text=r.text, detail=r.detail) for r in gallery.rejected]
        return Work.one({"template_gallery": pa.Table.from_pylist(rows, schema=TEMPLATES),
                         "template_rejects": pa.Table.from_pylist(rejects, schema=REJECTS)},
                        {"input_rows": gallery.candidates, "accepted": len(rows),
                         "rejected": dict(Counter(r["reason"] for r in rejects)), "gallery_version": gallery.version,
                         "sampled_captions": len(sample),
                         "by_origin": dict(Counter(t.origin for t in gallery.templates))})

    def report(self, run: StageRun, result: StageResult) -> Report:
        version = result.stats.get("gallery_version")
        return Report(log=f"template-gallery: {result.accepted} templates ({version}), "
                          f"{sum(result.rejected.values())} candidates rejected")

"""The caption pool's fate for one captioned image (DSMM-TBIR statistics come from these captions).

Every chosen image ends as exactly one caption or one image-level reject (stage ``caption-pool``);
dropped sentences and discarded generations are extra detail rows (stage ``caption-pool-sentence``)
that say why a caption is shorter than what was generated, not what became of the image.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, Generator
from models.backends.slot_layout import slot_layout
from models.domains import DomainSet
from models.prompt_files import PromptFile
from rde.common.generation_retries import error_reason
from rde.common.image_decoding import decoded_images
from rde.common.pool_config import TrackFactsSpec
from rde.common.reasons import Reason, rejected_row
from rde.common.text_diversity import diversity_by_domain
from rde.common.track_context import track_facts
from rde.secmm import sentence_checks
from rde.secmm.config import QueriesSpec
from rde.secmm.sentence_checks import CaptionCheck, facts_caption
from storage import Artifact

IMAGE_STAGE = "caption-pool"  # the image's one row
SENTENCE_STAGE = "caption-pool-sentence"  # a dropped sentence of a kept (or rejected) pool caption


@dataclass
class PoolCaption:
    """What one captioned image gives: its caption row or its reject row, plus detail rows."""

    caption: dict[str, Any] | None
    rejects: list[dict[str, Any]] = field(default_factory=list)
    clean: bool = False  # the generated text passed every sentence check as it was
    rendered: bool = False  # the caption was said from the measured facts


def pool_caption(result: GenerationResult, check: CaptionCheck, values: dict[str, list[str]] | None,
                 from_facts: dict[str, Any], domain: str, prompt_identity: str,
                 wording: dict[str, Any] | None = None) -> PoolCaption:
    """The kept sentences of a generated caption; when none is left (every sentence a fragment or
    ungrounded, or the captioner refused the whole text as ungrounded) the caption is rendered from
    the measured ``values`` with the prompt file's ``from_facts`` sentences (``wording``: its
    ``phrases`` and ``derived``, see ``facts_caption``). A failed generation of
    another kind (timeout, refusal) is the image's reject row: it is not papered over."""
    image_id = result.request_id
    details = []
    if not result.ok:
        if not (error_reason(result.error) == "ungrounded" and values is not None and from_facts):
            return PoolCaption(None, [_reject(image_id, domain, IMAGE_STAGE, error_reason(result.error), None,
                                              result.error)])
        details.append(_reject(image_id, domain, SENTENCE_STAGE, str(Reason.UNGROUNDED_ATTRIBUTE), None,
                               result.error))
    details += [_reject(image_id, domain, SENTENCE_STAGE, d.reason, d.text, d.detail) for d in check.dropped]
    text, q_txt, source, rendered = check.kept, result.mean_token_probability, result.model_id, False
    if not text and values is not None and from_facts:
        wording = wording or {}
        text = facts_caption(values, from_facts, wording.get("phrases"), wording.get("derived"), image_id)
        q_txt, source = None, f"{result.model_id}+facts"
        rendered = bool(text)
    if not text:
        reason = check.dropped[0].reason if check.dropped else str(Reason.EMPTY)
        return PoolCaption(None, [*details, _reject(image_id, domain, IMAGE_STAGE, reason, result.text,
                                                    "no complete, grounded sentence")], check.clean)
    row = {"image_id": image_id, "domain": domain, "text": text, "q_txt": q_txt, "generator": source,
           "prompt": prompt_identity}
    return PoolCaption(row, details, check.clean, rendered)


def _reject(image_id: str, domain: str, stage: str, reason: str, text: str | None,
            detail: str | None) -> dict[str, Any]:
    """A rejected pool caption (kind ``caption``) or one sentence dropped from a kept one (``sentence``)."""
    return rejected_row(image_id, stage, reason, kind="sentence" if stage == SENTENCE_STAGE else "caption",
                        domain=domain, image_id=image_id, text=text, detail=detail)


def caption_sample(generator: Generator, accepted: Artifact, domains: DomainSet, q: QueriesSpec, prompt: PromptFile,
                   track_spec: TrackFactsSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The pool captions of a seeded sample of the denoised pool (``accepted``), per domain: each
    sampled image captioned by ``generator``, its sentences checked and its fate decided by
    ``pool_caption``. ``q`` is the profile's ``queries`` section (``seed``,
    ``caption_sample_per_domain``, ``caption_max_tokens``). Returns the caption rows, the reject
    rows (image-level and dropped sentences) and the stage's stats."""
    rows = accepted.rows(["image_id", "domain"])  # no bytes: only the sampled images are read
    rng = np.random.default_rng(q.seed)
    captions, rejects = [], []
    generic = set(prompt.extras.get("generic_words", []))
    measured = getattr(generator, "measured_facts", None)  # composed captioners expose their facts
    generated = clean_before = rendered = 0
    for domain in sorted({r["domain"] for r in rows} & set(domains.names)):
        mine = [r for r in rows if r["domain"] == domain]
        pick = rng.choice(len(mine), size=min(q.caption_sample_per_domain, len(mine)), replace=False)
        chosen = [mine[i] for i in sorted(pick)]
        images = decoded_images(accepted, [r["image_id"] for r in chosen])
        tracks = track_facts(accepted, [r["image_id"] for r in chosen], track_spec, domains)
        requests = [GenerationRequest(r["image_id"], [ChatMessage("user", domains[domain].captions.request,
                                                                  [images[r["image_id"]]],
                                                                  [tracks.get(r["image_id"], {})])],
                                      max_tokens=q.caption_max_tokens, temperature=0.0)
                    for r in chosen]
        generated += len(requests)
        results = generator.generate(requests)
        # complete sentences only, and (where the generator measured facts) only what was measured
        facts = [measured([images[r.request_id]], [tracks.get(r.request_id, {})])[0] if measured else None
                 for r in results]
        subject = domains[domain].subject  # its nouns state no attribute of it
        checks = sentence_checks.check_captions([r.text if r.ok else "" for r in results],
                                                [f.allowed if f else None for f in facts],
                                                generic | set(subject.allowed) | {subject.noun},
                                                int(prompt.extras.get("restart_ngram", 3)),
                                                needs_object=prompt.extras.get("needs_object", []))
        from_facts = domains[domain].captions.from_facts
        for res, check, fact in zip(results, checks, facts, strict=True):
            decided = pool_caption(res, check, fact.values if fact else None, from_facts, domain,
                                   prompt.identity, prompt.extras)
            captions += [decided.caption] if decided.caption else []
            rejects += decided.rejects
            clean_before += decided.clean
            rendered += decided.rendered
    image_rows = [r for r in rejects if r["stage"] == IMAGE_STAGE]
    stats = {"input_rows": generated, "accepted": len(captions),
             "rejected": dict(Counter(r["reason"] for r in image_rows)),
             "dropped_sentences": dict(Counter(r["reason"] for r in rejects if r["stage"] == SENTENCE_STAGE)),
             "generated_captions_clean": clean_before, "rendered_from_facts": rendered,
             "diversity": diversity_by_domain(captions, slot_layout(domains))}
    return captions, rejects, stats

"""The caption pool's fate for one captioned image (DSMM-TBIR statistics come from these captions).

Every chosen image ends as exactly one caption or one image-level reject (stage ``caption-pool``);
dropped sentences and discarded generations are extra detail rows (stage ``caption-pool-sentence``)
that say why a caption is shorter than what was generated, not what became of the image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.backends.interfaces import GenerationResult
from rde.common.generation_retries import error_reason
from rde.common.reasons import Reason, rejected_row
from rde.secmm.sentence_checks import CaptionCheck, facts_caption

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

"""Device and dtype selection shared by the torch backends."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda, then mps, then cpu; an explicit accelerator that is absent is an error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available (set device: cpu or auto)")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise RuntimeError(f"device {name!r} requested but MPS is not available (set device: cpu or auto)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Half precision only on accelerators; the CPU computes in float32."""
    return torch.float32 if device.type == "cpu" else _DTYPES[name]


def batched(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def load_image_text_model(spec, role: str):
    """Processor and ``AutoModelForImageTextToText`` of a vision-language model by id or path, on the
    spec's device and dtype, processor padding on the left (batched generation and last-token
    pooling need the real last token at position -1). Returns (processor, model, device, dtype)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor, model, device, dtype = _load_pretrained(spec, role, AutoProcessor, AutoModelForImageTextToText)
    processor.tokenizer.padding_side = "left"
    return processor, model, device, dtype


def _load_pretrained(spec, role: str, front_class, model_class):
    """``front_class`` (a processor or tokenizer) and ``model_class`` from ``spec.model_id``, the model
    in eval mode on the spec's device and dtype; a missing or unreadable model is a ModelLoadError."""
    from models.backends.model_errors import ModelLoadError, hub_hint

    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    trust = bool(spec.options.get("trust_remote_code", False))
    try:
        front = front_class.from_pretrained(spec.model_id, revision=spec.revision, trust_remote_code=trust)
        model = model_class.from_pretrained(spec.model_id, revision=spec.revision, dtype=dtype,
                                            trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(hub_hint(role, spec.model_id, exc)) from exc
    model.eval().to(device)
    return front, model, device, dtype


def text_only_llm(spec) -> bool:
    """Whether ``spec.model_id`` is a text-only causal LM (Qwen3, Llama...): its config's model type
    maps to ``AutoModelForCausalLM`` and not to ``AutoModelForImageTextToText``. Reads the config
    only (a local folder or the Hugging Face cache)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    from models.backends.model_errors import ModelLoadError, hub_hint

    try:
        config = AutoConfig.from_pretrained(spec.model_id, revision=spec.revision,
                                            trust_remote_code=bool(spec.options.get("trust_remote_code", False)))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(hub_hint("generator", spec.model_id, exc)) from exc
    kind = getattr(config, "model_type", "")
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def load_text_model(spec, role: str):
    """Tokenizer and ``AutoModelForCausalLM`` of a text-only LLM by id or path, as
    ``load_image_text_model`` loads a vision-language one (padding on the left). Returns
    (tokenizer, model, device, dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model, device, dtype = _load_pretrained(spec, role, AutoTokenizer, AutoModelForCausalLM)
    tokenizer.padding_side = "left"
    return tokenizer, model, device, dtype

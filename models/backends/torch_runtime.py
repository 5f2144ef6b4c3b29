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

    from models.backends.model_errors import ModelLoadError, hub_hint

    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    trust = bool(spec.options.get("trust_remote_code", False))
    try:
        processor = AutoProcessor.from_pretrained(spec.model_id, revision=spec.revision, trust_remote_code=trust)
        model = AutoModelForImageTextToText.from_pretrained(spec.model_id, revision=spec.revision, dtype=dtype,
                                                            trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(hub_hint(role, spec.model_id, exc)) from exc
    model.eval().to(device)
    processor.tokenizer.padding_side = "left"
    return processor, model, device, dtype

"""Errors raised when a model cannot be loaded, with a message that says what to do."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says which and how to point the profile at it."""


def hub_hint(role: str, model_id: str, exc: BaseException) -> str:
    """The message for a model id that could not be loaded (usually: offline, not downloaded)."""
    return (
        f"{role}: could not load {model_id!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
        "Model hubs are not reached at run time: fetch the profile's models once where the hub is reachable "
        "(`rde models fetch --profile <yours>`: into the Hugging Face cache), or download this one (e.g. "
        f"`huggingface-cli download {model_id} --local-dir models/weights/{model_id.split('/')[-1]}`) and set "
        "model_id in the profile to that local folder, or pick an offline backend (`rde models --profile demo` "
        "lists them)."
    )

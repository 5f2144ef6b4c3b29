"""Loading a named retriever (``load_retriever``) as a ``TextImageExpert`` whose vectors are checked.

Every loaded retriever is wrapped in ``CheckedExpert``: its vectors must be 2-D, one row per input,
float, finite, of one width for texts and images; they are L2-normalised. It is checked on one
text and one image when loaded, so a broken model fails before the evaluation spends time on it.
A student (``student:``) is loaded by ``rde.evaluation.retriever_student``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import numpy as np

from models.backends.interfaces import TextImageExpert
from models.specs import ModelSpec
from rde.evaluation.retriever_specs import (
    MODEL_KINDS,
    RetrieverError,
    RetrieverSpec,
    existing_path,
    looks_like_path,
    open_clip_parts,
    python_module_file,
    split_python_target,
)

PROBE_TEXT = "a person in a red jacket"
PROBE_IMAGE = np.full((64, 32, 3), 127, np.uint8)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


class CheckedExpert:
    """A retriever whose ``encode_text`` / ``encode_image`` results are validated and L2-normalised;
    any other attribute is the wrapped object's (``track_slots`` of the attribute expert, ...)."""

    def __init__(self, inner: Any, name: str, model_id: str | None = None, preprocessing: str | None = None) -> None:
        self.inner, self.name = inner, name
        self.model_id = model_id or str(getattr(inner, "model_id", None) or name)
        self.preprocessing = preprocessing or str(getattr(inner, "preprocessing", None) or name)
        declared = getattr(inner, "dim", None)
        self.declared_dim = int(declared) if isinstance(declared, int | np.integer) and declared > 0 else None
        self.dim = 0  # set by ``probe``
        self._widths: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _check(self, method: str, out: Any, n: int, noun: str) -> np.ndarray:
        where = f"{self.name}: {method}"
        try:
            array = np.asarray(out)
        except (TypeError, ValueError) as exc:
            raise RetrieverError(f"{where} returned {type(out).__name__}, not an array ({exc})") from None
        if array.ndim != 2 or array.shape[0] != n:
            raise RetrieverError(f"{where} returned shape {array.shape} for {_count(n, noun)} "
                                 f"(one row per {noun} expected)")
        if not np.issubdtype(array.dtype, np.floating):
            raise RetrieverError(f"{where} returned dtype {array.dtype}, not float")
        bad = ~np.isfinite(array)
        if bad.any():
            kinds = sorted({"NaN" if np.isnan(v) else "inf" for v in array[bad][:100]})
            rows = np.unique(np.nonzero(bad)[0])
            raise RetrieverError(f"{where} returned {'/'.join(kinds)} values in {_count(len(rows), 'row')} of {n} "
                                 f"(first: row {int(rows[0])})")
        width, other = int(array.shape[1]), "encode_image" if method == "encode_text" else "encode_text"
        self._widths.setdefault(method, width)
        if self.declared_dim is not None and width != self.declared_dim:
            raise RetrieverError(f"{where} returned width {width} but the model's dim is {self.declared_dim}")
        if width != self._widths[method] or (other in self._widths and width != self._widths[other]):
            raise RetrieverError(f"{where} returned width {width}, {other} width {self._widths.get(other, width)}: "
                                 "texts and images must share one space")
        return unit_rows(array.astype(np.float32, copy=False))

    def encode_text(self, texts: list[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        return self._check("encode_text", self.inner.encode_text(texts), len(texts), "text")

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        images = list(images)
        if not images:
            return np.zeros((0, self.dim), np.float32)
        return self._check("encode_image", self.inner.encode_image(images), len(images), "image")

    def probe(self) -> CheckedExpert:
        """Encode one text and one image: the checks run (widths equal) and ``dim`` is known."""
        try:
            self.encode_text([PROBE_TEXT])
            self.encode_image([PROBE_IMAGE])
        except RetrieverError:
            raise
        except Exception as exc:  # user or model code failing on a plain input: one line, naming it
            raise RetrieverError(f"{self.name}: encoding one text and one image failed "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
        self.dim = self._widths["encode_text"]
        return self


def unit_rows(array: np.ndarray, tolerance: float = 1e-5) -> np.ndarray:
    """Rows scaled to unit L2 norm; a row already unit (within ``tolerance``) or zero is kept bit for
    bit: a model that normalises its own vectors (the profile's experts) scores here exactly as in
    the build's stages, where exact ties in score are broken by gallery order and a re-division by
    a norm of 0.99999994 could reorder them."""
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    keep = (np.abs(norms - 1.0) <= tolerance) | (norms == 0)
    return np.where(keep, array, array / np.where(keep, 1.0, norms)).astype(np.float32)


def _one_line(exc: BaseException) -> str:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0][:200] if text else ''}"


def _model_spec(spec: RetrieverSpec, device: str) -> ModelSpec:
    if spec.kind == "open-clip":
        arch, pretrained = open_clip_parts(spec)
        if pretrained and looks_like_path(pretrained):
            pretrained = str(existing_path(spec.text, pretrained))
        if arch.endswith(".json"):
            arch = str(existing_path(spec.text, arch))
        options = {"pretrained": pretrained} if pretrained else {}
        return ModelSpec(backend="open-clip", model_id=arch, device=device, options=options)
    target = str(existing_path(spec.text, spec.target)) if looks_like_path(spec.target) else spec.target
    return ModelSpec(backend=spec.kind, model_id=target, device=device)


def _load_model(spec: RetrieverSpec, profile: Any, device: str) -> Any:
    from models.backends.clip_experts import OPEN_CLIP_MISSING
    from models.backends.registry import ModelRegistry

    model_spec = _model_spec(spec, device)
    try:
        return ModelRegistry.of(profile).expert(model_spec)
    except Exception as exc:
        if OPEN_CLIP_MISSING in str(exc):
            raise RetrieverError(OPEN_CLIP_MISSING) from exc
        local = looks_like_path(spec.target) or (spec.kind == "open-clip" and looks_like_path(
            open_clip_parts(spec)[1] or ""))
        local_form = "a checkpoint file (open-clip:<arch>:/path/weights.pt)" if spec.kind == "open-clip" \
            else "a local folder"
        hint = (f"is it a {spec.kind} model?" if local else
                "hub ids and pretrained tags are not downloaded at run time: fetch it once where the hub is reachable "
                f"(`rde models fetch`, into the Hugging Face cache) or give {local_form}")
        raise RetrieverError(f"{spec.text}: could not load ({_one_line(exc)}); {hint}") from exc


def profile_expert(spec: RetrieverSpec, profile: Any) -> ModelSpec:
    """The profile expert ``expert:<name>`` names: the one whose ``model_id`` is ``<name>``, else the
    one whose ``backend`` is (it must be the only one)."""
    experts = list(profile.models.experts)
    found = [e for e in experts if e.model_id == spec.target] or [e for e in experts if e.backend == spec.target]
    known = ", ".join(f"{e.backend} ({e.model_id})" for e in experts) or "none"
    if not found:
        raise RetrieverError(f"{spec.text}: profile {profile.name!r} has no expert with backend or model_id "
                             f"{spec.target!r} (its experts: {known})")
    if len(found) > 1:
        raise RetrieverError(f"{spec.text}: {len(found)} experts of profile {profile.name!r} have backend "
                             f"{spec.target!r}: name one by model_id ({known})")
    return found[0]


def _import_module(spec: RetrieverSpec, module: str) -> Any:
    source = python_module_file(spec.text, module)
    try:
        if module.endswith(".py") or "/" in module or os.sep in module:
            name = f"rde_user_retriever_{abs(hash(str(source))):x}"
            loader_spec = importlib.util.spec_from_file_location(name, source)
            assert loader_spec is not None and loader_spec.loader is not None
            loaded = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = loaded  # dataclasses and pickling look their module up here
            loader_spec.loader.exec_module(loaded)
            return loaded
        added = os.getcwd() not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            return importlib.import_module(module)
        finally:
            if added:
                sys.path.remove(os.getcwd())
    except Exception as exc:
        raise RetrieverError(f"{spec.text}: importing {source} failed ({_one_line(exc)})") from exc


def _load_python(spec: RetrieverSpec) -> Any:
    module_name, factory_name = split_python_target(spec.target)
    target: Any = _import_module(spec, module_name)
    for part in factory_name.split("."):
        if not hasattr(target, part):
            raise RetrieverError(f"{spec.text}: module {module_name!r} has no {factory_name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise RetrieverError(f"{spec.text}: {factory_name!r} is a {type(target).__name__}, not a factory to call")
    try:
        made = target()
    except Exception as exc:
        raise RetrieverError(f"{spec.text}: {factory_name}() failed ({_one_line(exc)})") from exc
    missing = [m for m in ("encode_text", "encode_image") if not callable(getattr(made, m, None))]
    if missing:
        raise RetrieverError(f"{spec.text}: {factory_name}() returned a {type(made).__name__} without "
                             f"{' and '.join(missing)}")
    return made


def load_retriever(spec: RetrieverSpec, profile: Any, device: str = "auto") -> TextImageExpert:
    """The retriever ``spec`` names, loaded and checked (``CheckedExpert``). ``device`` is where a
    model named by hub id, folder or file runs (``auto``: an accelerator when there is one); a
    profile expert runs where the profile says, a student on ``device`` too. ``scores:`` names no
    model: a ``RetrieverError``."""
    if spec.kind == "scores":
        raise RetrieverError(f"{spec.text}: a scores file is a precomputed ranking, not a model to load "
                             "(read it with rde.evaluation.scores_file.read_scores)")
    if spec.kind in MODEL_KINDS:
        inner = _load_model(spec, profile, device)
    elif spec.kind == "expert":
        from models.backends.registry import ModelRegistry

        model_spec = profile_expert(spec, profile)
        try:
            inner = ModelRegistry.of(profile).expert(model_spec)
        except Exception as exc:
            raise RetrieverError(f"{spec.text}: could not load the profile's {model_spec.backend} expert "
                                 f"({_one_line(exc)})") from exc
    elif spec.kind == "student":
        from rde.evaluation.retriever_student import load_student

        inner = load_student(spec, profile, device)
    elif spec.kind == "python":
        inner = _load_python(spec)
    else:  # parse_retriever admits no other kind
        raise RetrieverError(f"{spec.text}: unknown kind {spec.kind!r}")
    model_id = None if spec.kind in ("expert", "python") and getattr(inner, "model_id", None) else spec.text
    return CheckedExpert(inner, spec.text, model_id=model_id).probe()

"""What a retriever's results depend on (``retriever_lineage``): it enters the keys of its evaluation
stages, so a changed checkpoint, module or scores file re-scores that model and no other. Content
fingerprints are ``retriever_specs.fingerprint``'s."""

from __future__ import annotations

from typing import Any

from models.backends.registry import ModelRegistry
from rde.evaluation.retriever_loading import profile_expert
from rde.evaluation.retriever_specs import (
    RetrieverSpec,
    existing_path,
    fingerprint,
    looks_like_path,
    model_location,
    open_clip_parts,
    python_module_file,
    sha256_file,
    split_python_target,
)
from rde.evaluation.retriever_student import student_lineage


def retriever_lineage(spec: RetrieverSpec, profile: Any) -> dict[str, Any]:
    """What this model's results depend on (module docstring for fingerprints): the model's
    content or hub id; for ``expert:`` the registry's lineage of that expert; for ``student:``
    the checkpoint's content and the training configuration it is read with; for ``python:`` the
    module file's SHA-256 and the factory; for ``scores:`` the file's SHA-256."""
    out: dict[str, Any] = {"kind": spec.kind, "target": spec.target}
    if spec.kind in ("transformers-clip", "sentence-transformers"):
        out.update(model_location(spec.text, spec.target))
    elif spec.kind == "open-clip":
        arch, pretrained = open_clip_parts(spec)
        out["arch"] = model_location(spec.text, arch) if arch.endswith(".json") else arch
        if pretrained:
            out["pretrained"] = model_location(spec.text, pretrained) if looks_like_path(pretrained) \
                else {"tag": pretrained}
        elif arch.startswith("local-dir:"):
            out["arch"] = {"content": fingerprint(existing_path(spec.text, arch.split(":", 1)[1]))}
    elif spec.kind == "expert":
        out["expert"] = ModelRegistry.of(profile).lineage(profile_expert(spec, profile))
    elif spec.kind == "student":
        out.update(student_lineage(spec, profile))
    elif spec.kind == "python":
        module, factory = split_python_target(spec.target)
        source = python_module_file(spec.text, module)
        out.update({"module": module, "factory": factory, "file_sha256": sha256_file(source)})
    else:  # scores
        out["sha256"] = sha256_file(existing_path(spec.text, spec.target))
    return out

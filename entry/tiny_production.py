"""The production path on tiny models: the ``tiny-production`` profile over a slice of the demo
pool, its flows one after another, in a working folder of their own.

The profile names its models by paths below ``.rde/tiny-models`` (relative, like production's
``models/weights/...``), so a run builds them there (``build_tiny_production``) and runs from that
folder. What a caller may change, and why:

* ``device``: every model spec's device (the profile says ``cpu``; a GPU check says ``cuda``).
* the generators' backend, and the text LLM's (``query_generator``, ``template_generator``): in-process
  vLLM (``vllm``, the profile's) needs a GPU; without one, or without the ``vllm`` package, the same
  tiny Qwen2-VL and tiny Qwen3 run through ``transformers-vlm``.
* ``queries.max_rounds`` 1 and 32-token answers for DAP and the template gallery: the tiny
  Qwen3's random text gives DAP no query and the gallery no template, and ten rounds per domain or
  256-token answers would say nothing more about the path than one round of short ones.
* the demo check set, so ``evaluate`` runs every expert (the random captions give DAP no query,
  and MECF nothing to retrieve for).

Used by ``tests/test_tiny_production.py`` and ``scripts/gpu_check.py`` (the whole-path slice).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entry.demo_pool import write_pool_slice
from entry.tiny_models import TINY_MODELS_FOLDER, build_tiny_production
from rde.profile import PROFILE_DIR, Profile, deep_merge, load_profile

PROFILE = "tiny-production"
FLOWS = ("build-secmm", "build-largefine", "train-saft", "train-gtr", "train-vedje", "index-cache", "rerank")
REPO = PROFILE_DIR.parent
DEMO_POOL = REPO / "data" / "demo_pool"
CHECK_SET = REPO / "data" / "check_set" / "queries.yaml"
# every 45th crop of the demo pool, in 6-row shards: 11 pedestrians and a vehicle; the tiny detector
# sees one person in every image, so the vehicle ends as no_target
SLICE_STEP, SLICE_IMAGES, SLICE_SHARD_ROWS = 45, 12, 6


def flow_function(name: str) -> Callable[..., dict[str, Any]]:
    """The flow function of a flow name (imported on use: each pulls in its own stages)."""
    import flows.build_largefine
    import flows.build_secmm
    import flows.index_cache
    import flows.rerank
    import flows.train_gtr
    import flows.train_saft
    import flows.train_vedje

    return {"build-secmm": flows.build_secmm.build_secmm, "build-largefine": flows.build_largefine.build_largefine,
            "train-saft": flows.train_saft.train_saft, "train-gtr": flows.train_gtr.train_gtr,
            "train-vedje": flows.train_vedje.train_vedje, "index-cache": flows.index_cache.index_cache,
            "rerank": flows.rerank.rerank}[name]


def generator_backend_for(device: str) -> str:
    """``vllm`` where in-process vLLM can run (a CUDA device and the package), else ``transformers-vlm``."""
    return "vllm" if device.startswith("cuda") and importlib.util.find_spec("vllm") is not None \
        else "transformers-vlm"


def run_overrides(profile: Profile, device: str, generator_backend: str, pool_url: str,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The overrides of a tiny-production run (see the module docstring), then ``extra``."""
    models = profile.models.model_dump(mode="json", exclude_none=True)
    for role in ("detector", "image_embedder", "text_encoder", "teacher"):
        if role in models:
            models[role]["device"] = device
    for spec in models["experts"] + models["generators"]:
        spec["device"] = device
    text_llms = [models[role] for role in ("query_generator", "template_generator") if role in models]
    for spec in models["generators"] + text_llms:
        spec["backend"] = generator_backend
    for spec in text_llms:
        spec["device"] = device
    out: dict[str, Any] = {"input": {"kind": "pool", "path": pool_url}, "models": models,
                           "queries": {"max_rounds": 1, "max_tokens": 32},
                           "largefine": {"templates": {"max_tokens": 32}},
                           "evaluation": {"check_sets": [str(CHECK_SET)], "check_set_pool": str(DEMO_POOL)}}
    for section, spec in (("training", profile.training.model), ("vedje", profile.vedje.backbone)):
        if spec is not None:
            key = "model" if section == "training" else "backbone"
            out[section] = {key: spec.model_dump(mode="json", exclude_none=True) | {"device": device}}
    return deep_merge(out, extra or {})


@dataclass
class FlowOutcome:
    """One flow of a path run: its summary, or the message it stopped with."""

    flow: str
    seconds: float
    summary: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class PathRun:
    """A tiny-production run's folder, pool slice and overrides; ``run`` takes flows through it."""

    workdir: Path
    device: str = "cpu"
    generator_backend: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    artifacts: str = "artifacts"  # the runs' output root, below workdir

    def __post_init__(self) -> None:
        self.workdir = self.workdir.resolve()
        self.generator_backend = self.generator_backend or generator_backend_for(self.device)
        self.output_root = str(self.workdir / self.artifacts)
        self.pool_url = str(self.workdir / "pool")

    def prepare(self) -> None:
        """Build the tiny models (kept when there) and write the pool slice (once)."""
        build_tiny_production(self.workdir / TINY_MODELS_FOLDER)
        if not (Path(self.pool_url) / "_manifest.json").exists():
            write_pool_slice(str(DEMO_POOL), self.pool_url, SLICE_STEP, SLICE_IMAGES, SLICE_SHARD_ROWS, PROFILE)

    def overrides(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return run_overrides(load_profile(PROFILE), self.device, str(self.generator_backend), self.pool_url,
                             deep_merge(self.extra, extra or {}))

    def run(self, flows: Sequence[str] = FLOWS, extra: dict[str, Any] | None = None,
            stop_on: tuple[type[BaseException], ...] = ()) -> list[FlowOutcome]:
        """Run ``flows`` in order from the working folder; an exception of ``stop_on`` types is kept
        as that flow's ``error`` (and the next flows still run), any other is raised."""
        self.prepare()
        overrides = self.overrides(extra)
        out = []
        with contextlib.chdir(self.workdir):
            for name in flows:
                started = time.perf_counter()
                try:
                    summary = flow_function(name)(profile=PROFILE, overrides=overrides, output_root=self.output_root)
                    out.append(FlowOutcome(name, time.perf_counter() - started, summary))
                except stop_on as exc:
                    out.append(FlowOutcome(name, time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}"))
        return out

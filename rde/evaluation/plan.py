"""What an evaluation run compares, resolved from the profile's ``evaluation`` section: the benchmark
(opened once per flow run), the retrievers as parsed specs, the reference, and the folders the
artifacts live in under the flow's folder: a model's gallery vectors in ``<benchmark>/<model>/``
(whatever the labels), its scores and the comparison in ``<benchmark>-<labels>/``."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from rde.evaluation.benchmarks import Benchmark, open_benchmark
from rde.evaluation.retrievers import RetrieverError, RetrieverSpec, parse_retriever, retriever_lineage
from storage.filesystem import join
from storage.hashing import sha256_json
from storage.locations import flow_root, resolve_location

_opened: dict[tuple[Any, ...], Benchmark] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class EvaluationPlan:
    """The benchmark, the models (in the order given) and the reference, and where it all goes.
    ``profile`` is the whole profile the plan was made from: the models load and key with it."""

    profile: Any
    benchmark: Benchmark
    models: tuple[RetrieverSpec, ...]
    reference: RetrieverSpec
    gallery_folder: str  # "<benchmark name>-<8 hex of its location>": the gallery vectors, any labels
    lineages: dict[RetrieverSpec, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def folder(self) -> str:
        """The comparison's folder: ``<gallery folder>-<labels>``."""
        return f"{self.gallery_folder}-{self.benchmark.labels}"

    def model_folder(self, spec: RetrieverSpec) -> str:
        """Where a model's scores for these labels go."""
        return f"{self.folder}/{spec.slug}"

    def vectors_folder(self, spec: RetrieverSpec) -> str:
        """Where a model's gallery vectors go: shared by every label set of the benchmark."""
        return f"{self.gallery_folder}/{spec.slug}"

    def lineage(self, spec: RetrieverSpec) -> dict[str, Any]:
        """``retriever_lineage`` of a model, computed once per plan (it hashes files)."""
        if spec not in self.lineages:
            self.lineages[spec] = retriever_lineage(spec, self.profile)
        return self.lineages[spec]


def forget_benchmarks() -> None:
    """Drop the benchmarks opened and models loaded so far: a new flow run reads its benchmark afresh
    (it may have been rebuilt, or its labels imported, since a run before it in this process)."""
    with _lock:
        _opened.clear()
        _loaded.clear()


def default_benchmark(profile: Any, output_root: str | None) -> str:
    """The profile's own build-secmm benchmark under the run's output root."""
    return join(flow_root(profile.artifacts_root, "build-secmm", profile.name, output_root), "benchmark")


def benchmark_of(profile: Any, output_root: str | None) -> Benchmark:
    """The profile's benchmark, opened once per flow run in a process (``forget_benchmarks``; a
    fan-out worker opens it again)."""
    section = profile.evaluation
    location = section.benchmark or default_benchmark(profile, output_root)
    location = location if "://" in location else resolve_location(location)
    key = (location, section.labels, section.check_set_pool, sha256_json(profile.track_facts.model_dump()),
           profile.domain_set.fingerprint)
    with _lock:
        if key not in _opened:
            _opened[key] = open_benchmark(location, section.labels, section.check_set_pool, profile.track_facts,
                                            profile.domain_set)
        return _opened[key]


def model_specs(profile: Any) -> tuple[RetrieverSpec, ...]:
    """The retrievers to compare: the section's model specs, or each of the profile's experts.
    A spec given twice is one model."""
    texts = profile.evaluation.models or [f"expert:{spec.model_id}" for spec in profile.models.experts]
    specs = tuple(dict.fromkeys(parse_retriever(t) for t in texts))
    if not specs:
        raise RetrieverError("no model to evaluate: give --model (or evaluation.models), or name experts in the "
                             "profile")
    return specs


def plan_evaluation(profile: Any, output_root: str | None) -> EvaluationPlan:
    """The profile's evaluation, resolved; a reference that is not among the models is an error."""
    bench = benchmark_of(profile, output_root)
    specs = model_specs(profile)
    reference = specs[0]
    if profile.evaluation.reference:
        wanted = parse_retriever(profile.evaluation.reference)
        if wanted not in specs:
            raise RetrieverError(f"--reference {profile.evaluation.reference} is not among the models: "
                                 f"{', '.join(s.text for s in specs)}")
        reference = wanted
    readable = re.sub(r"[^a-z0-9]+", "-", bench.name.lower()).strip("-")[:40] or "benchmark"
    return EvaluationPlan(profile, bench, specs, reference,
                          f"{readable}-{sha256_json([bench.location, bench.kind])[:8]}")


_loaded: dict[str, Any] = {}


def loaded_retriever(spec: RetrieverSpec, profile: Any, lineage: dict[str, Any] | None = None) -> Any:
    """The retriever ``spec`` names, loaded once per flow run for the same lineage (its stages and
    every gallery shard of a worker share it: a user's factory is called once). ``lineage``: the
    spec's, when the caller has it (else computed)."""
    from rde.evaluation.retrievers import load_retriever

    key = sha256_json([spec.text, lineage if lineage is not None else retriever_lineage(spec, profile)])
    with _lock:
        if key not in _loaded:
            _loaded[key] = load_retriever(spec, profile)
        return _loaded[key]

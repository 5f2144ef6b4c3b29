"""Ingest stage: the profile's inputs → ``images`` + ``ingest_rejects``, one Prefect task per shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rde.common.ingest import ingest_container, ingest_shard
from rde.common.input_confinement import allowed_roots
from rde.common.input_listing import InputError, describe_listing, list_inputs, list_pool, shard_refs
from storage import Artifact
from storage.locations import project_root, resolve_location
from storage.schemas import IMAGES, REJECTS
from tasks.framework import accounting
from tasks.framework.reporting import log
from tasks.framework.stage import Lineage, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class IngestInputs:
    """The listing, read once by ``lineage``: its chunks (one per shard), the domains, the pool an
    input pool's rows come from, and the roots inputs may be read under."""

    chunks: list[Any]
    domains: list[str]
    pool_url: str | None
    roots: Any


class Ingest(Stage):
    """Read and verify every listed input: one image row or one reject row (with its reason) each.
    For video input, the inputs are the crops the videos stage cut (read as a pool is)."""

    name = "ingest"
    version = "2"  # bump when the ingest logic changes what it writes
    writes = (Write("images", "images", IMAGES), Write("ingest_rejects", "rejects", REJECTS, rejects=True))
    config = ("input", "ingest", "domains")
    prepares = IngestInputs
    balance = True
    title = "Ingest: inputs read and verified; rejected rows by reason code"
    row_unit = "images"
    retry_by = "input_id"  # a read that failed (object store, permissions) is read again on --retry-rejects

    def lineage(self, run: StageRun) -> Lineage:
        """The listing (paths, sizes, modification times) is what the outputs depend on."""
        spec, ingest = run.section("input"), run.section("ingest")
        domains = [d.name for d in run.section("domains")]
        if spec.kind == "video":
            pool_url = run.output_url("video_crops")
            if not Artifact(pool_url).is_complete():
                raise InputError(f"video input: the videos stage's crops at {pool_url} are not complete")
            refs, fingerprint = list_pool(pool_url)
        else:
            refs, fingerprint = list_inputs(spec, project_root(), domains)
            pool_url = resolve_location(spec.path) if spec.kind == "pool" else None
        run.prepared = IngestInputs(shard_refs(refs, ingest.shard_size), domains, pool_url,
                                    allowed_roots(spec, project_root()))
        unit = f"{spec.kind} shards (one ingest shard each)" if spec.kind in ("webdataset", "image_parquet") else \
            f"inputs {describe_listing(refs)} in shards of {ingest.shard_size}"
        log(f"ingest: {len(refs)} {unit}")
        return Lineage(extra={"listing": fingerprint}, upstream=[Artifact(pool_url)] if pool_url else [])

    def shard_count(self, run: StageRun) -> int:
        return len(run.prepared.chunks)

    def process(self, run: StageRun, index: int) -> Work:
        """A chunk of listed inputs, or one input shard (a tar, an image Parquet) whose input count is
        its samples as the shard itself counts them (member names, Parquet footer)."""
        inputs_: IngestInputs = run.prepared
        refs, only = inputs_.chunks[index], run.retry_only
        if refs and refs[0].container is not None:  # a retry reads the container again, keeps its retried samples
            images, rejects, inputs = ingest_container(refs[0], run.section("ingest"), inputs_.domains,
                                                       roots=inputs_.roots)
            if only is not None:
                images, rejects, inputs = _only(images, only), _only(rejects, only), len(only)
        else:
            refs = refs if only is None else [r for r in refs if r.input_id in only]
            images, rejects = ingest_shard(refs, run.section("ingest"), inputs_.domains, inputs_.pool_url,
                                           roots=inputs_.roots)
            inputs = len(refs)
        return Work.one({"images": images, "ingest_rejects": rejects},
                        {"input_rows": inputs, "accepted": images.num_rows,
                         "rejected": accounting.reason_counts(rejects)})


def _only(table: pa.Table, ids: frozenset[str]) -> pa.Table:
    """The rows of the inputs ``ids`` (a retried container shard's)."""
    return table.filter(pc.is_in(table.column("input_id"), pa.array(sorted(ids))))

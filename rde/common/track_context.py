"""The track facts of accepted images: what a crop's video track says about its subject (motion,
direction, distance; ``models.backends.track_facts``), read for the images a stage captions.

Only the chosen images' metadata is read, one shard's row groups at a time, and reduced to the
facts before the next shard: memory is the selection's facts, not the artifact's metadata.
"""

from __future__ import annotations

from collections.abc import Iterable

from models.backends.track_facts import MotionOptions, motion_facts
from models.domains import DomainSet
from rde.common.pool_config import TrackFactsSpec
from storage import Artifact


def motion_options(spec: TrackFactsSpec) -> MotionOptions:
    """The profile's ``track_facts`` as the measuring code's options."""
    return MotionOptions(**spec.model_dump())


def track_facts(accepted: Artifact, image_ids: Iterable[str], spec: TrackFactsSpec, domains: DomainSet
                ) -> dict[str, dict[str, list[str]]]:
    """Per wanted image id, its track facts in its domain's terms (an empty dict for an image
    without a track)."""
    wanted = set(image_ids)
    options = motion_options(spec)
    found: dict[str, dict[str, list[str]]] = {}
    for shard in accepted.manifest().shards:
        if len(found) == len(wanted):
            break
        table = accepted.read_matching(shard.index, "image_id", wanted - set(found),
                                       ["image_id", "domain", "source_meta"])
        for row in table.to_pylist():
            found[row["image_id"]] = motion_facts(row["source_meta"], domains.get(row["domain"]), options)
    return found

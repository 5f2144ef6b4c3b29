"""The captions a training or reranker flow learns from: a build-largefine run's ``largefine``
artifact, finished and holding at least one caption.

A run whose generator wrote nothing usable (every tier rejected, as a random-weight or broken
model does) leaves an empty artifact; training on it would fail deep inside the GMM fit or the
split draw. This says so up front, with the rejects' commonest reasons.
"""

from __future__ import annotations

from collections import Counter

from storage import Artifact
from storage.filesystem import join

TOP_REASONS = 4  # reasons named in the message


class NoCaptionsError(FileNotFoundError, ValueError):
    """The source run has no finished captions, or kept none (the message says which and why). A
    missing input (FileNotFoundError) and a bad one (ValueError) alike: callers catching either
    for a message, as the CLI does, get this one too."""


def finished_captions(source_root: str, flow: str) -> Artifact:
    """The ``largefine`` artifact under ``source_root``; raises ``NoCaptionsError`` when it is not
    finished or holds no row (``flow`` names what needs it, for the message)."""
    captions = Artifact(join(source_root, "largefine"))
    if not captions.is_complete():
        raise NoCaptionsError(f"no finished captions at {captions.url}: run `rde build-largefine` first "
                              f"({flow} learns from its captions)")
    if captions.count_rows() == 0:
        rejects = Artifact(join(source_root, "caption_rejects"))
        reasons = Counter(r["reason"] for r in rejects.rows(["reason"])) if rejects.is_complete() else Counter()
        said = ", ".join(f"{reason} {n}" for reason, n in reasons.most_common(TOP_REASONS)) or "no rejects recorded"
        raise NoCaptionsError(f"the build-largefine run at {source_root} kept no caption ({sum(reasons.values())} "
                              f"rejected: {said}; see {rejects.url}): {flow} has nothing to learn from. Check the "
                              "generators (models.generators) and the tiers' rejects")
    return captions

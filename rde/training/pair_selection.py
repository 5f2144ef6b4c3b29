"""Which captions of a build-largefine run train, which are held out for person search, which
are rejected (a check-set identity, over ``training.max_pairs``), decided in passes that keep
scalars and identities, never the captions; and the layouts the training features are written in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from rde.common.expert_check import held_out_identities, load_check_yaml
from rde.common.reasons import declare_reason
from rde.common.seeds import draw_seed
from rde.training.pair_stream import FEATURE_PAIRS_KIND
from storage import Artifact
from storage.locations import resolve_location
from storage.schemas import TRAINING_FEATURE_PAIRS, TRAINING_FEATURES, TRAINING_PAIRS

CHECK_SET_IDENTITY = declare_reason("check_set_identity", "training-features",
                                    "a caption of a check-set identity: kept out of training")
OVER_MAX_PAIRS = declare_reason("over_max_pairs", "training-features",
                                "beyond training.max_pairs (a seeded sample is kept)")


@dataclass(frozen=True)
class PairSelection:
    """Which captions train, decided in passes over the captions that keep scalars and identities,
    never the captions: a caption of a check-set identity is rejected (``check_set_identity``); with
    ``training.max_pairs`` the pairs with the smallest seeded keys are kept (``over_max_pairs`` for
    the rest); a seeded share of the kept pairs' identities is held out for the person search."""

    identity: dict[str, str | None]
    check_ids: set[str]
    cutoff: int | None  # keep a pair whose key is at most this (None: every pair)
    held: set[str]
    seed: int

    def key(self, image_id: str, text: str) -> int:
        return draw_seed(self.seed, image_id + text)

    def verdict(self, image_id: str, text: str) -> str:
        """train | heldout | a reason."""
        person = self.identity.get(image_id)
        if person in self.check_ids:
            return CHECK_SET_IDENTITY
        if self.cutoff is not None and self.key(image_id, text) > self.cutoff:
            return OVER_MAX_PAIRS
        return "heldout" if person in self.held else "train"

    @classmethod
    def of(cls, training: Any, check_sets: Sequence[str], source_root: str, captions: Artifact) -> PairSelection:
        """Decide, in passes over ``captions``: ``training`` is the profile's training section (its
        ``max_pairs``, ``held_out_share``, ``seed``); identities come from the source run's
        ``neighbours``; a check set's identities are never trained on."""
        t = training
        identity = {r["image_id"]: r["identity"]
                    for r in Artifact(f"{source_root}/neighbours").rows(["image_id", "identity"])}
        check_ids = {i for f in check_sets for i in held_out_identities(load_check_yaml(Path(resolve_location(f))))}

        def candidates() -> Iterator[tuple[str, str]]:
            for _, table in captions.iter_shards(["image_id", "text"]):
                yield from zip(table.column("image_id").to_pylist(), table.column("text").to_pylist(), strict=True)

        selection = cls(identity, check_ids, None, set(), t.seed)
        if t.max_pairs is not None:  # the seeded keys of the candidates, 8 bytes each
            keys = np.fromiter((selection.key(i, text) for i, text in candidates() if identity.get(i) not in check_ids),
                               dtype=np.uint64)
            if len(keys) > t.max_pairs:
                cutoff = int(np.partition(keys, t.max_pairs - 1)[t.max_pairs - 1])
                selection = cls(identity, check_ids, cutoff, set(), t.seed)
        people = sorted({identity[i] for i, text in candidates()
                         if selection.verdict(i, text) == "train" and identity.get(i)})
        rng = np.random.default_rng(t.seed)
        held = set(rng.choice(people, size=max(1, int(t.held_out_share * len(people))), replace=False).tolist()) \
            if len(people) > 1 else set()
        return cls(identity, check_ids, selection.cutoff, held, t.seed)


class PairCounts:
    """The captions a pass read, by verdict: the stage's input, splits and rejects."""

    def __init__(self) -> None:
        self.read, self.splits, self.rejected = 0, {"train": 0, "held_out": 0}, Counter()

    def add(self, verdict: str) -> int | None:
        """Count one caption: its pair id within its split (0, 1, ... in reading order) when it
        trains or is held out, else None."""
        self.read += 1
        if verdict in ("train", "heldout"):
            split = "train" if verdict == "train" else "held_out"
            self.splits[split] += 1
            return self.splits[split] - 1
        self.rejected[verdict] += 1
        return None

    def stats(self) -> dict[str, Any]:
        return {"input_rows": self.read, "accepted": sum(self.splits.values()), "splits": dict(self.splits),
                "rejected": dict(self.rejected)}


def image_key(image_id: str) -> int:
    """A 63-bit key equal for the pairs of one image (the ITM hard negative skips them)."""
    return draw_seed(0, image_id)


Layout = Literal["features", "feature_pairs", "pairs"]


LAYOUTS: dict[str, tuple[str, pa.Schema]] = {  # layout → the artifact's kind and schema
    "features": ("training_features", TRAINING_FEATURES), "feature_pairs": (FEATURE_PAIRS_KIND, TRAINING_FEATURE_PAIRS),
    "pairs": ("training_pairs", TRAINING_PAIRS)}


def features_layout(training: Any, captions: int) -> Layout:
    """How the training-features stage writes (``TrainingFeatures``): images for a CLIP-like student;
    the CPU model's features in memory, or streamed above ``training.stream_above`` captions."""
    t = training
    if t.model is not None:
        return "pairs"
    return "feature_pairs" if t.stream_above is not None and captions > t.stream_above else "features"

"""``--retry-rejects``: a rerun redoes only the inputs rejected for a transient reason.

First with a per-shard toy stage whose inputs fail once (the runner's contract: which shards are
redone, which rows are asked for, what is kept, the recount), then the real ingest stage reading a
store that drops every connection on the first run and none on the second.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from PIL import Image
from prefect import flow

from rde.common.reasons import TRANSIENT, Reason
from rde.profile import load_profile
from storage import Artifact
from tasks.framework.accounting import AccountingError, StageResult
from tasks.framework.context import RunContext
from tasks.framework.runner import run_stage
from tasks.framework.stage import Stage, StageRun, Work, Write
from tasks.pool.ingest import Ingest

ROWS = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.string(), nullable=False)])
REJECTS = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("reason", pa.string(), nullable=False)])
# inputs per shard: "…t" fails for a transient reason while the toy is told to fail, "…x" is always
# rejected for a reason that a retry cannot change; shard 2 has no transient reject
INPUTS = {0: ["a", "bt", "c", "dx"], 1: ["et", "ft", "g"], 2: ["h", "ix"]}


class _Toy(Stage):
    name = "toy"
    version = "1"
    writes = (Write("rows", "rows", ROWS), Write("rejects", "rejects", REJECTS, rejects=True))
    balance = True
    retry_by = "id"

    def __init__(self, failing: set[str], asked: list[tuple[int, frozenset[str] | None]], lose: bool = False,
                 deaf: bool = False) -> None:
        self.failing, self.asked, self.lose, self.deaf = failing, asked, lose, deaf  # deaf: ignores retry_only

    def shard_count(self, run: StageRun) -> int:
        return len(INPUTS)

    def process(self, run: StageRun, index: int) -> Work:
        self.asked.append((index, run.retry_only))
        inputs = [i for i in INPUTS[index] if run.retry_only is None or self.deaf or i in run.retry_only]
        kept = [i for i in inputs if not i.endswith("x") and i not in self.failing]
        bad = [(i, "not_sampled" if i.endswith("x") else "timeout" if i.startswith(("e", "f")) else "read_error")
               for i in inputs if i not in kept]  # a read that failed, a generator that did not answer
        if self.lose and run.retry_only:
            kept = kept[1:]  # a bug: a retried input ends as nothing
        rejected: dict[str, int] = {}
        for _, reason in bad:
            rejected[reason] = rejected.get(reason, 0) + 1
        return Work.one({"rows": pa.table({"id": kept, "value": [f"v-{i}" for i in kept]}, schema=ROWS),
                         "rejects": pa.table({"id": [i for i, _ in bad], "reason": [r for _, r in bad]},
                                             schema=REJECTS)},
                        {"input_rows": len(inputs), "accepted": len(kept), "rejected": rejected, "calls": len(inputs)})


def _run(tmp_path: Path, stage: Stage, retry: bool) -> StageResult:
    @flow(name="retry-check")
    def run() -> StageResult:
        ctx = RunContext(load_profile("demo"), "retry-check", str(tmp_path / "out"), retry_rejects=retry)
        return run_stage(ctx, stage)

    return run()


def _artifact(tmp_path: Path, name: str) -> Artifact:
    return Artifact(str(tmp_path / "out" / "retry-check" / "demo" / name))


def test_transient_reasons_are_the_ones_a_retry_can_change() -> None:
    assert {str(r) for r in TRANSIENT} == {"read_error", "access_denied", "generation_failed", "timeout"}
    assert Reason.NOT_AN_IMAGE not in TRANSIENT and Reason.UNGROUNDED not in TRANSIENT


def test_a_retry_redoes_only_the_transient_rejects_and_keeps_every_other_row(tmp_path: Path) -> None:
    asked: list[tuple[int, frozenset[str] | None]] = []
    first = _run(tmp_path, _Toy({"bt", "et", "ft"}, asked), retry=False)
    assert (first.accepted, first.rejected) == (4, {"read_error": 1, "timeout": 2, "not_sampled": 2})
    rows, rejects = _artifact(tmp_path, "rows"), _artifact(tmp_path, "rejects")
    before = {i: (s.sha256, s.file) for i, s in enumerate(rows.manifest().shards)}

    asked.clear()  # a plain rerun: the stage is complete for its key, nothing is asked again
    assert _run(tmp_path, _Toy(set(), asked), retry=False).skipped and asked == []

    retried = _run(tmp_path, _Toy({"ft"}, asked), retry=True)  # "ft" fails again
    assert sorted(asked, key=lambda a: a[0]) == [(0, frozenset({"bt"})), (1, frozenset({"et", "ft"}))]
    assert not retried.skipped and retried.shards_resumed == 1
    assert (retried.input_rows, retried.accepted, retried.rejected) == (9, 6, {"timeout": 1, "not_sampled": 2})
    assert (retried.stats["retried"], retried.stats["recovered"]) == (3, 2)
    assert retried.stats["calls"] == 9 + 3  # work counters add the retry's work
    assert rows.manifest().shards[2].sha256 == before[2][0]  # the shard without transient rejects is kept
    assert rows.read_shard(0).column("id").to_pylist() == ["a", "c", "bt"]  # kept rows, then the recovered one
    assert rejects.read_shard(0).to_pylist() == [{"id": "dx", "reason": "not_sampled"}]
    assert rejects.read_shard(1).to_pylist() == [{"id": "ft", "reason": "timeout"}]
    assert rows.shard_stats(1) == {"input_rows": 3, "accepted": 2, "rejected": {"timeout": 1}, "calls": 5}

    asked.clear()
    again = _run(tmp_path, _Toy(set(), asked), retry=True)
    assert asked == [(1, frozenset({"ft"}))] and again.stats["recovered"] == 1
    assert (again.accepted, again.rejected) == (7, {"not_sampled": 2})
    asked.clear()  # nothing transient is left: the stage is skipped even when asked to retry
    assert _run(tmp_path, _Toy(set(), asked), retry=True).skipped and asked == []


def test_a_retry_that_loses_a_row_is_refused_and_leaves_the_shards_as_they_were(tmp_path: Path) -> None:
    asked: list[tuple[int, frozenset[str] | None]] = []
    _run(tmp_path, _Toy({"bt"}, asked), retry=False)
    with pytest.raises(AccountingError, match="after retrying 1 inputs"):
        _run(tmp_path, _Toy(set(), asked, lose=True), retry=True)
    assert _run(tmp_path, _Toy(set(), asked), retry=False).shards_resumed == 3  # complete again, as it was
    with pytest.raises(AccountingError, match="asked to redo 1 inputs, it wrote rows rows of 2 others"):
        _run(tmp_path, _Toy(set(), asked, deaf=True), retry=True)  # its other rows would be written twice
    assert not _artifact(tmp_path, "rows").is_complete()  # refused before any file was replaced:
    asked.clear()
    result = _run(tmp_path, _Toy(set(), asked), retry=False)  # the first run's shards, all reused
    assert asked == [] and result.shards_resumed == 3
    assert (result.accepted, result.rejected) == (6, {"not_sampled": 2, "read_error": 1})
    assert _run(tmp_path, _Toy(set(), asked), retry=True).rejected == {"not_sampled": 2}


class _DroppingStore(MemoryFileSystem):
    """An object store that drops every ranged read while ``down`` is set."""

    protocol = "dropping"
    store: dict = {}  # noqa: RUF012 - its own objects, not memory://'s
    pseudo_dirs = [""]  # noqa: RUF012
    down = True
    reads: list[str] = []  # noqa: RUF012

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.replace("dropping://", "memory://", 1))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.reads.append(path)
        if self.down and path.endswith(("b.jpg", "c.jpg")):
            raise ConnectionResetError("connection reset by peer")
        return super().cat_file(path, start, end, **kwargs)


def _jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def test_ingest_reads_again_only_the_objects_the_store_dropped(tmp_path: Path) -> None:
    """The real ingest stage on a store that drops b.jpg and c.jpg on every try of the first run
    (read_error after the profile's attempts), and nothing on the second: only those two objects are
    read again, and the rejected row of an object that is not an image stays as it was."""
    fsspec.register_implementation("dropping", _DroppingStore, clobber=True)
    store = _DroppingStore()
    store.pipe({f"dropping://in/{n}.jpg": _jpeg(k) for k, n in enumerate("abcd")})
    store.pipe({"dropping://in/e.jpg": b"not an image"})
    _DroppingStore.down, _DroppingStore.reads = True, []
    overrides = {"input": {"kind": "folder", "path": "dropping://in/"},
                 "ingest": {"shard_size": 3, "retry_backoff_s": 0.0, "read_attempts": 2}}
    profile = load_profile("demo", overrides)

    def run(retry: bool) -> StageResult:
        @flow(name="retry-check")
        def body() -> StageResult:
            return run_stage(RunContext(profile, "retry-check", str(tmp_path / "out"), retry_rejects=retry), Ingest())

        return body()

    first = run(False)
    assert (first.accepted, first.rejected) == (2, {"read_error": 2, "not_an_image": 1})
    images, rejects = _artifact(tmp_path, "images"), _artifact(tmp_path, "ingest_rejects")
    kept_shard = images.manifest().shards[1]  # d.jpg, e.jpg: nothing transient there
    _DroppingStore.down, _DroppingStore.reads = False, []
    second = run(True)
    assert sorted(_DroppingStore.reads) == ["/in/b.jpg", "/in/c.jpg"]  # memory:// keys: only these were read
    assert (second.accepted, second.rejected) == (4, {"not_an_image": 1})
    assert (second.stats["retried"], second.stats["recovered"]) == (2, 2)
    assert images.manifest().shards[1].sha256 == kept_shard.sha256
    got = {r["source"].rsplit("/", 1)[-1]: r["image_bytes"] for r in images.rows(["source", "image_bytes"])}
    assert got == {f"{n}.jpg": _jpeg(k) for k, n in enumerate("abcd")}
    assert [r["reason"] for r in rejects.rows(["reason"])] == ["not_an_image"]


def test_a_tier_stage_redoes_an_image_and_drops_its_share_of_the_shard_counts() -> None:
    """The captioning tiers retry by image: the rows an image had (a caption of one tier, the
    reject of the other) leave the shard's ``images`` and Table 1 word counts (hand-counted:
    "a man in a red coat" is 6 words)."""
    from storage.schemas import QA_PAIRS, TIER_CAPTIONS
    from storage.schemas import REJECTS as REJECT_ROWS
    from tasks.largefine.qa_tiers import QaTiers

    caption = {name: None for name in TIER_CAPTIONS.names}
    caption.update(image_id="img-1", source="s", domain="pedestrian", tier="base", text="a man in a red coat")
    reject = {name: None for name in REJECT_ROWS.names}
    reject.update(input_id="img-1", image_id="img-1", kind="caption", stage="tier-inter", reason="timeout",
                  all_reasons=["timeout"])
    removed = {"tier12_captions": pa.Table.from_pylist([caption], schema=TIER_CAPTIONS),
               "qa_pairs": QA_PAIRS.empty_table(),
               "tier12_rejects": pa.Table.from_pylist([reject], schema=REJECT_ROWS)}
    gone = QaTiers().removed_stats(removed)
    assert gone["images"] == 1 and gone["table1.base.words"] == 6
    assert QaTiers.retry_by == "image_id" and all("image_id" in s.names for s in (TIER_CAPTIONS, QA_PAIRS, REJECT_ROWS))

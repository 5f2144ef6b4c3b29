"""``batch_size: auto``: measured once, kept per machine, logged, overridable, and results unchanged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from models.backends import auto_batch
from models.backends.auto_batch import AutoBatchSettings, BatchSize, Measurement, choose
from models.backends.registry import ModelRegistry, models_lineage, spec_lineage
from models.specs import ModelSpec
from rde.profile import load_profile


class FakeModel:
    """A batched forward whose cost per call is ``fixed + per_item_sq * b²`` seconds on a fake clock:
    per-item time is lowest at b = 4 (fixed / b + per_item_sq * b)."""

    def __init__(self, fixed: float = 0.016, per_item_sq: float = 0.001) -> None:
        self.now, self.fixed, self.per_item_sq = 0.0, fixed, per_item_sq
        self.calls: list[int] = []

    def clock(self) -> float:
        return self.now

    def run(self, batch: list[object]) -> None:
        self.calls.append(len(batch))
        self.now += self.fixed + self.per_item_sq * len(batch) ** 2


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeModel:
    model = FakeModel()
    monkeypatch.setattr(auto_batch, "_clock", model.clock)
    monkeypatch.delenv(auto_batch.CACHE_ENV, raising=False)
    auto_batch.set_cache_file(tmp_path / "auto_batch.json")
    auto_batch.forget()
    yield model
    auto_batch.forget()
    auto_batch.set_cache_file(None)


def test_auto_keeps_the_fastest_per_item_batch_and_logs_the_curve(fake: FakeModel,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    size = BatchSize("auto", "fake:model", "cpu")
    with caplog.at_level(logging.INFO, logger=auto_batch.__name__):
        chosen = size.resolve("image", list(range(5)), fake.run)
    assert chosen == 4
    assert size.last is not None and size.last["source"] == "measured"
    assert set(size.last["curve"]) == {"1", "2", "4", "8", "16", "32"}  # two worse sizes in a row stop it
    assert set(fake.calls) == {1, 2, 4, 8, 16, 32}  # inputs repeated cyclically up to each size
    assert "fake:model image on cpu: batch 4 (items/s by batch: 1: " in caplog.text


def test_auto_choice_is_cached_per_machine_and_not_measured_again(fake: FakeModel, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    items = list(range(8))
    assert BatchSize("auto", "fake:model", "cpu").resolve("image", items, fake.run) == 4
    measured_calls = len(fake.calls)
    assert BatchSize("auto", "fake:model", "cpu").resolve("image", items, fake.run) == 4  # same process
    auto_batch.forget()  # a new process: only the file remains
    again = BatchSize("auto", "fake:model", "cpu")
    with caplog.at_level(logging.INFO, logger=auto_batch.__name__):
        assert again.resolve("image", items, fake.run) == 4
    assert len(fake.calls) == measured_calls and again.last and again.last["source"] == "cache"
    assert "batch 4 (cached in" in caplog.text
    entries = json.loads((tmp_path / "auto_batch.json").read_text())
    (key,) = entries
    assert "fake:model | image | cpu | " in key and auto_batch.machine_fingerprint(again.device) in key
    # another operation, model or machine measures anew
    BatchSize("auto", "fake:model", "cpu").resolve("text", items, fake.run)
    assert len(fake.calls) > measured_calls


def test_explicit_batch_size_wins_and_is_never_measured(fake: FakeModel) -> None:
    assert BatchSize(16, "fake:model", "cpu").resolve("image", list(range(40)), fake.run) == 16
    assert fake.calls == []


def test_choice_prefers_the_smallest_batch_within_tolerance() -> None:
    curve = [Measurement(1, 1.0), Measurement(4, 0.50), Measurement(16, 0.49), Measurement(64, 0.60)]
    assert choose(curve, tolerance=0.05) == 4
    assert choose(curve, tolerance=0.0) == 16


def test_settings_come_from_options_and_unknown_keys_fail() -> None:
    s = AutoBatchSettings.from_options({"auto_batch": {"cpu_candidates": [8, 2, 2], "repeats": 1}})
    assert s.cpu_candidates == (2, 8) and s.repeats == 1
    with pytest.raises(ValueError, match="unknown keys"):
        AutoBatchSettings.from_options({"auto_batch": {"candidate": [1]}})


def test_profiles_default_to_auto_and_generators_keep_numbers() -> None:
    for name in ("demo", "production"):
        models = load_profile(name).models
        specs = [models.image_embedder, models.text_encoder, *models.experts]
        assert all(s is not None and s.batch_size == "auto" for s in specs), name
    with pytest.raises(ValidationError, match="batch_size 'auto' is measured only for"):
        ModelSpec(backend="vllm", model_id="x", batch_size="auto")


def test_batch_size_stays_out_of_stage_keys() -> None:
    auto = ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0", batch_size="auto")
    assert spec_lineage(auto) == spec_lineage(auto.model_copy(update={"batch_size": 16}))
    assert "batch_size" not in spec_lineage(auto)
    models = load_profile("demo").models
    fixed = models.model_copy(update={"experts": [s.model_copy(update={"batch_size": 16}) for s in models.experts],
                                      "image_embedder": models.image_embedder.model_copy(update={"batch_size": 16})})
    assert models_lineage(models) == models_lineage(fixed)
    gen = ModelSpec(backend="transformers-vlm", model_id="x", batch_size=4)  # padding can change generated text
    assert spec_lineage(gen)["batch_size"] == 4


@pytest.mark.slow  # real weights; measuring on a loaded 2-core machine can take minutes
def test_auto_embeddings_equal_fixed_batch_embeddings(pool_rows: dict[str, dict], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever auto picks, vectors match batch 1 and batch 16 within float tolerance (real weights)."""
    from rde.common.image_decoding import decode_rgb

    monkeypatch.setenv(auto_batch.CACHE_ENV, str(tmp_path / "auto_batch.json"))
    images = [decode_rgb(r["image_bytes"]) for r in pool_rows.values() if r["variant"] == "crop"][:20]
    registry = ModelRegistry.of(load_profile("demo"))
    # keep the measuring short in a test; memo off, or the second size would reuse the first's vectors
    fast = {"auto_batch": {"cpu_candidates": [2, 8], "repeats": 1}, "memo_items": 0}
    vectors = {}
    for batch in (1, 16, "auto"):
        spec = ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0", batch_size=batch, options=fast)
        vectors[batch] = registry.image_embedder(spec).embed(images)
    assert np.allclose(vectors["auto"], vectors[1], atol=1e-5) and np.allclose(vectors[16], vectors[1], atol=1e-5)
    texts = [f"a person in a {c} coat walking past a parked car" for c in ("red", "blue", "grey", "white")] * 5
    enc = {b: registry.text_encoder(ModelSpec(backend="sentence-transformers", model_id="bundled:all-MiniLM-L6-v2",
                                              batch_size=b, options=fast)).encode(texts) for b in (1, "auto")}
    assert np.allclose(enc["auto"], enc[1], atol=1e-5)


def test_on_cuda_the_batch_stays_within_the_memory_budget(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-item time keeps falling with batch size (as on a GPU); peak memory 10 bytes per item and
    1000 bytes free: with memory_fraction 0.8 the largest allowed batch is 64 (128 would need 1280)."""
    import types

    import torch

    fake.fixed, fake.per_item_sq = 0.1, 0.0
    peak = {"bytes": 0}

    def run(batch: list[object]) -> None:
        fake.run(batch)
        peak["bytes"] = 10 * len(batch)

    for name, value in {"mem_get_info": lambda d=None: (1000, 4000), "synchronize": lambda d=None: None,
                        "reset_peak_memory_stats": lambda d=None: None, "memory_allocated": lambda d=None: 0,
                        "max_memory_allocated": lambda d=None: peak["bytes"],
                        "get_device_properties": lambda d=None: types.SimpleNamespace(name="fake", total_memory=4000),
                        }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    size = BatchSize("auto", "fake:model", "cuda")
    assert size.resolve("image", list(range(3)), run) == 64
    assert max(fake.calls) == 64 and size.last and size.last["peak_bytes"]["64"] == 640


def test_the_time_cap_stops_the_search_only_after_min_sizes(fake: FakeModel) -> None:
    """On a slow (loaded) machine the cap ends measuring early, but never on the smallest size alone."""
    size = BatchSize("auto", "fake:model", "cpu", AutoBatchSettings(max_seconds=0.0, min_sizes=4))
    assert size.resolve("image", list(range(3)), fake.run) == 4
    assert size.last and set(size.last["curve"]) == {"1", "2", "4", "8"}

"""Speed without changing results: batch norms folded into convs, and one forward / one detector
pass shared by the backends of a stage through a content-keyed memo."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from domain_sets import DOMAINS

from models.backends import auto_batch, content_memo
from models.backends.content_memo import ContentMemo, image_digest
from models.backends.detectors import SsdMobileNetDetector
from models.backends.image_embedders import EfficientNetLiteEmbedder, fold_batch_norms
from models.backends.registry import ModelRegistry, models_lineage, spec_lineage
from models.specs import DetectorSpec, ModelSpec
from rde.profile import load_profile


def _images(values: list[int]) -> list[np.ndarray]:
    return [np.full((4, 3, 3), v, np.uint8) for v in values]


def test_memo_computes_each_distinct_image_once_and_keeps_at_most_capacity() -> None:
    memo: ContentMemo[int] = ContentMemo(capacity=3)
    asked: list[list[int]] = []

    def compute(images: list[np.ndarray]) -> list[int]:
        asked.append([int(im[0, 0, 0]) for im in images])
        return [int(im[0, 0, 0]) * 10 for im in images]

    assert memo.get_or_compute("a", _images([1, 2, 2, 3]), compute) == [10, 20, 20, 30]
    assert asked == [[1, 2, 3]]  # the repeated image is computed once
    # equal pixels in another array are a hit; only 4 is new
    assert memo.get_or_compute("a", _images([3, 4, 1]), compute) == [30, 40, 10]
    assert asked[-1] == [4] and len(memo) == 3  # 2 was the least recently used: evicted
    assert memo.get_or_compute("a", _images([2]), compute) == [20] and asked[-1] == [2]
    assert memo.get_or_compute("b", _images([1]), compute) == [10] and asked[-1] == [1]  # namespaces never mix
    assert (memo.hits, memo.misses) == (3, 6)


def test_memo_of_capacity_zero_keeps_nothing_and_checks_result_counts() -> None:
    off = content_memo.shared_memo("test-off", 0)
    assert off is not content_memo.shared_memo("test-off", 0)  # private: nothing shared
    calls: list[int] = []
    for _ in range(2):
        off.get_or_compute("x", _images([7]), lambda ims: calls.append(len(ims)) or [1])
    assert calls == [1, 1] and len(off) == 0
    with pytest.raises(ValueError, match="1 images"):
        ContentMemo(4).get_or_compute("x", _images([1]), lambda ims: [])


def test_memo_keeps_rows_of_a_batch_as_copies_not_views_of_the_batch() -> None:
    """A remembered row must not keep its batch's array alive (a 10k-image CGDS pass grew by 1.4 GB
    when the EfficientNet memo kept row views); values are equal, owned copies; owned ones are kept as is."""
    memo: ContentMemo[np.ndarray] = ContentMemo(capacity=8)
    batch = np.arange(4 * 1280, dtype=np.float32).reshape(4, 1280)
    images = _images([1, 2, 3, 4])
    rows = memo.get_or_compute("x", images, lambda ims: list(batch))  # rows: views into batch
    assert all(r.base is not None for r in rows)
    kept = memo.get_or_compute("x", images, lambda ims: pytest.fail("recomputed"))
    assert all(k.base is None and k.flags.owndata for k in kept)
    assert all(np.array_equal(k, b) for k, b in zip(kept, batch, strict=True))
    owned = [np.ones(3, np.float32)]
    memo.remember("y", _images([5]), owned)
    assert memo.get_or_compute("y", _images([5]), lambda ims: pytest.fail("recomputed"))[0] is owned[0]


def test_digest_tells_shape_and_pixels_apart() -> None:
    a = np.zeros((2, 6, 3), np.uint8)
    assert image_digest(a) == image_digest(a.copy())
    assert image_digest(a) != image_digest(a.reshape(6, 2, 3))  # same bytes, other shape
    b = a.copy()
    b[1, 5, 2] = 1
    assert image_digest(a) != image_digest(b)
    assert image_digest(a[:, ::2]) == image_digest(np.ascontiguousarray(a[:, ::2]))  # views hash their pixels


def test_fold_batch_norms_matches_a_hand_computed_value() -> None:
    """One input channel, one output channel, 1×1 conv weight 2, BN γ=3, β=1, μ=4, σ²=3, ε=1:
    y = 3·(2x − 4)/2 + 1 = 3x − 5; folded: W′ = 1.5·2 = 3, b′ = 1.5·(0 − 4) + 1 = −5."""
    net = torch.nn.Module()
    net._conv_stem = torch.nn.Conv2d(1, 1, 1, bias=False)
    net._bn0 = torch.nn.BatchNorm2d(1, eps=1.0)
    with torch.no_grad():
        net._conv_stem.weight.fill_(2.0)
        net._bn0.weight.fill_(3.0)
        net._bn0.bias.fill_(1.0)
        net._bn0.running_mean.fill_(4.0)
        net._bn0.running_var.fill_(3.0)
    assert fold_batch_norms(net.eval(), (("_conv_stem", "_bn0"),)) == 1
    assert isinstance(net._bn0, torch.nn.Identity)
    assert net._conv_stem.weight.item() == pytest.approx(3.0) and net._conv_stem.bias.item() == pytest.approx(-5.0)
    x = torch.tensor([[[[0.0, 1.0], [2.0, -1.0]]]])
    assert torch.allclose(net._bn0(net._conv_stem(x)), 3 * x - 5)


@pytest.mark.slow  # two EfficientNet-Lite0 loads on real crops
def test_folded_channels_last_embedder_equals_the_plain_one(pool_rows: dict[str, dict]) -> None:
    from rde.common.image_decoding import decode_rgb

    images = [decode_rgb(r["image_bytes"]) for r in pool_rows.values() if r["variant"] == "crop"][:6]
    plain = EfficientNetLiteEmbedder(ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0",
                                               batch_size=2, options={"fold_batch_norm": False,
                                                                      "channels_last": False, "memo_items": 0}))
    fast = EfficientNetLiteEmbedder(ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0",
                                              batch_size=2, options={"memo_items": 0}))
    assert fast.folded and fast.memory_format == torch.channels_last  # the defaults
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fast.model.modules())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain.model.modules()) == 49  # stem, head, 47 in blocks
    assert np.allclose(fast.embed(images), plain.embed(images), atol=1e-5)
    assert np.allclose(fast.class_probabilities(images), plain.class_probabilities(images), atol=1e-5)
    assert np.allclose(fast.feature_maps(images), plain.feature_maps(images), atol=1e-3)


@pytest.mark.slow  # real EfficientNet-Lite0 and SSD-MobileNet
def test_bridge_embedder_and_attribute_expert_share_one_forward_and_one_detection(
        pool_rows: dict[str, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """``image_features``' order: the bridge (class probabilities + detections), the embedder on the
    same images, the attribute expert on the same images. The network runs once per image and the
    detector once, and the results equal those of backends that share nothing."""
    from models.backends.disk_memo import DETECTION_CACHE_ENV
    from rde.common.image_decoding import decode_rgb

    monkeypatch.delenv(DETECTION_CACHE_ENV, raising=False)  # the sharing within one process, not on disk

    content_memo.clear_all()
    images = [decode_rgb(r["image_bytes"]) for r in pool_rows.values() if r["variant"] == "crop"][10:16]
    models = load_profile("demo").models
    fixed = {"batch_size": 2}
    models = models.model_copy(update={
        "image_embedder": models.image_embedder.model_copy(update=fixed),
        "experts": [s.model_copy(update=fixed) for s in models.experts]})
    reg = ModelRegistry(models, DOMAINS)
    embedder, bridge, attributes = reg.image_embedder(), reg.expert(models.experts[0]), reg.expert(models.experts[1])
    assert bridge.embedder is embedder  # the profile's embedder at the bridge's batch size: one instance
    forwards, detections = [], []
    features, detect_all = embedder._features, reg.detector()._detect_all
    embedder._features = lambda b: (forwards.append(len(b)), features(b))[1]
    reg.detector()._detect_all = lambda ims: (detections.append(len(ims)), detect_all(ims))[1]
    try:
        shared = (bridge.encode_image(images), embedder.embed(images), attributes.encode_image(images))
        assert sum(forwards) == 6 and detections == [6]
        content_memo.clear_all()  # VEDJE's order: feature maps, then the stage-1 (bridge) embedding
        forwards.clear()
        maps = embedder.feature_maps(images[:4])
        assert np.allclose(bridge.encode_image(images[:4]), shared[0][:4], atol=1e-5)
        assert sum(forwards) == 4 and maps.shape == (4, 49, 1280)
    finally:
        del embedder._features, reg.detector()._detect_all

    off = load_profile("demo").models
    slow = {"options": {"memo_items": 0}}
    off = off.model_copy(update={"image_embedder": off.image_embedder.model_copy(update={**fixed, **slow}),
                                 "experts": [s.model_copy(update=fixed) for s in off.experts],
                                 "detector": off.detector.model_copy(update={"memo_items": 0})})
    reg_off = ModelRegistry(off, DOMAINS)
    alone = (reg_off.expert(off.experts[0]).encode_image(images), reg_off.image_embedder().embed(images),
             reg_off.expert(off.experts[1]).encode_image(images))
    for a, b in zip(shared, alone, strict=True):
        assert np.allclose(a, b, atol=1e-5)


def test_detector_memo_runs_each_new_image_once(person_crop: np.ndarray) -> None:
    detector = SsdMobileNetDetector(DetectorSpec(batch_size=4, score_threshold=0.41))  # its own namespace
    runs: list[int] = []
    detect_all = detector._detect_all
    detector._detect_all = lambda ims: (runs.append(len(ims)), detect_all(ims))[1]
    flipped = np.ascontiguousarray(person_crop[:, ::-1])
    first = detector.detect([person_crop, flipped])
    again = detector.detect([flipped, person_crop, person_crop])
    assert runs == [2]
    assert again[1] is first[0] and again[0] is first[1]
    assert len(first[0].of_classes({"person"})) == 1


def test_speed_only_settings_stay_out_of_stage_keys_but_shape_the_batch_choice() -> None:
    base = ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0", batch_size="auto")
    fast = base.model_copy(update={"options": {"fold_batch_norm": False, "channels_last": True, "memo_items": 0,
                                               "auto_batch": {"repeats": 1}}})
    assert spec_lineage(base) == spec_lineage(fast)
    other = base.model_copy(update={"options": {"top_k": 3}})  # a real option still counts
    assert spec_lineage(other) != spec_lineage(base)
    models = load_profile("demo").models
    assert models_lineage(models) == models_lineage(models.model_copy(update={
        "detector": models.detector.model_copy(update={"memo_items": 0})}))
    assert models_lineage(models) != models_lineage(models.model_copy(update={
        "detector": models.detector.model_copy(update={"score_threshold": 0.4})}))
    # a folded or channels-last network has its own speed curve: its own measured choice
    assert auto_batch.for_spec(base, "cpu").identity != auto_batch.for_spec(fast, "cpu").identity
    assert auto_batch.for_spec(base, "cpu").identity == auto_batch.for_spec(
        base.model_copy(update={"options": {"memo_items": 5}}), "cpu").identity


def test_a_composed_expert_is_rebuilt_when_its_parts_differ() -> None:
    """The bridge is built from the profile's embedder and detector: a registry whose embedder or
    detector differs gets its own bridge (not the first registry's, built from other parts)."""
    models = load_profile("demo").models
    slow = models.model_copy(update={"image_embedder": models.image_embedder.model_copy(
        update={"options": {"fold_batch_norm": False, "memo_items": 0}})})
    other_detector = models.model_copy(update={"detector": models.detector.model_copy(update={"score_threshold": 0.3})})
    bridge = ModelRegistry(models, DOMAINS).expert(models.experts[0])
    assert ModelRegistry(models, DOMAINS).expert(models.experts[0]) is bridge
    slow_bridge = ModelRegistry(slow, DOMAINS).expert(slow.experts[0])
    assert slow_bridge is not bridge and not slow_bridge.embedder.folded and bridge.embedder.folded
    assert ModelRegistry(other_detector, DOMAINS).expert(models.experts[0]).detector.spec.score_threshold == 0.3
    attributes = ModelRegistry(models, DOMAINS).expert(models.experts[1])
    assert ModelRegistry(other_detector, DOMAINS).expert(models.experts[1]) is not attributes

"""The cached joint reranker's parts against hand-computed values (VEDJE Eq. 1–6, App. A.2–A.3)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict
from functools import partial

import numpy as np
import pytest
import torch
from ranking import unambiguous_top
from tiny_models import build_tiny_bert
from torch import nn

from models.reranker import onnx_scoring
from models.reranker.cache_store import CacheIndex, CacheLineageError, cache_rows, check_lineage
from models.reranker.compressor import FrameCompressor, patch_positions
from models.reranker.future_delta import FutureDeltaHead, delta_loss, horizon_patch_queries, valid_pairs
from models.reranker.joint_encoder import JointReranker, load_bert
from models.reranker.losses import cache_structure_loss, mlm_loss, vtc_loss, vtm_loss
from models.reranker.vedje import Vedje, VedjeShape
from rde.vedje.training import VedjeTrainConfig, learning_rate
from storage import ArtifactWriter


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture()
def reranker(tiny_bert_dir) -> JointReranker:
    bert, tok = load_bert(str(tiny_bert_dir))
    return JointReranker(bert, tok, item_dim=12, max_text_tokens=16)


def test_frame_groups_are_separate_and_ordered() -> None:
    """Eq. 1–2: Z(v) = [Z_1; …; Z_T]; changing frame 2 changes only group 2."""
    torch.manual_seed(0)
    comp = FrameCompressor(d_v=20, d=16, tokens_per_frame=3, frames=4, heads=8).eval()
    x = torch.randn(2, 4, 5, 20)
    z = comp(x)
    assert z.shape == (2, 12, 16)
    x2 = x.clone()
    x2[:, 2] += 1.0
    diff = (comp(x2) - z).abs().sum(dim=(0, 2))
    assert torch.all(diff[6:9] > 0) and torch.all(diff[:6] == 0) and torch.all(diff[9:] == 0)
    assert torch.allclose(comp.frame_tokens(x).reshape(2, 12, 16), z)
    assert comp.kv_proj.weight.shape == (16, 20) and comp.kv_proj.bias is None  # W_kv ∈ R^{d_v×d}
    layer = comp.decoder.layers[0]
    assert len(comp.decoder.layers) == 2 and layer.self_attn.num_heads == 8
    assert layer.linear1.out_features == 4 * 16 and layer.dropout.p == 0.1


def test_pooled_controls_keep_the_budget_but_lose_order() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 4, 5, 20)
    for structure in ("mean", "attention"):
        comp = FrameCompressor(20, 16, tokens_per_frame=2, frames=4, heads=4, structure=structure).eval()
        z = comp(x)
        assert z.shape == (1, 8, 16)  # T·M tokens, like the frame-indexed cache
        assert torch.allclose(comp(x[:, [3, 1, 0, 2]]), z, atol=1e-5)  # frame order is pooled away
    with pytest.raises(ValueError, match="structure"):
        FrameCompressor(20, 16, structure="max")  # type: ignore[arg-type]


def test_pre_norm_compressor_is_the_pre_ln_decoder_by_hand() -> None:
    """compressor_norm "pre": x = Q_0; x += SA(LN₁x); x += CA(LN₂x, X W_kv); x += FFN(LN₃x); Z = LN(x),
    recomputed from the layer's own weights (one layer, eval mode). "post" keeps PyTorch's layout
    (LN after each residual sum, no output LN)."""
    torch.manual_seed(0)
    comp = FrameCompressor(20, 16, tokens_per_frame=3, frames=1, layers=1, heads=4, norm="pre").eval()
    x = torch.randn(2, 1, 5, 20)
    layer, mem = comp.decoder.layers[0], comp.kv_proj(x[:, 0])
    h = comp.queries.unsqueeze(0).expand(2, -1, -1)
    a = layer.norm1(h)
    h = h + layer.self_attn(a, a, a, need_weights=False)[0]
    a = layer.norm2(h)
    h = h + layer.multihead_attn(a, mem, mem, need_weights=False)[0]
    h = h + layer.linear2(torch.nn.functional.gelu(layer.linear1(layer.norm3(h))))
    assert torch.allclose(comp(x), comp.decoder.norm(h), atol=1e-5)
    post = FrameCompressor(20, 16, tokens_per_frame=3, frames=1, layers=1, heads=4).eval()
    assert post.decoder.norm is None and not post.decoder.layers[0].norm_first
    with pytest.raises(ValueError, match="norm"):
        FrameCompressor(20, 16, norm="sandwich")  # type: ignore[arg-type]


def test_sinusoidal_queries_encode_horizon_then_patch() -> None:
    """App. A.2: first half of d encodes h, second half p (standard sinusoidal encoding)."""
    q = horizon_patch_queries([3], patches=4, d=8)
    assert q.shape == (4, 8)
    # row (h=3, p=2): first half = [sin 3, cos 3, sin(3·10000^-1/2), cos(3·10000^-1/2)]
    f = 10000 ** -0.5
    assert torch.allclose(q[2, :4], torch.tensor([math.sin(3), math.cos(3), math.sin(3 * f), math.cos(3 * f)]))
    assert torch.allclose(q[2, 4:], torch.tensor([math.sin(2), math.cos(2), math.sin(2 * f), math.cos(2 * f)]))
    assert torch.allclose(q[0, 4:], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert torch.equal(q[0, :4], q[3, :4])  # same horizon, different patch


def test_delta_loss_hand_computed() -> None:
    """Eq. 4 with T=4, H={1,3}: Ω = {(0,1),(1,1),(2,1),(0,3)}; per-element mean over Ω."""
    assert valid_pairs(4, (1, 3)) == [(0, 0), (1, 0), (2, 0), (0, 1)]
    x = torch.arange(4.0).reshape(1, 4, 1, 1).expand(1, 4, 2, 1).clone()  # X_t = t everywhere
    pred = torch.zeros(1, 4, 2, 2, 1)  # predicts no change
    # targets: X_{t+1} − X_t = 1 (three pairs), X_3 − X_0 = 3 (one pair) → mean of 1, 1, 1, 9 = 3
    assert float(delta_loss(pred, x, (1, 3))) == pytest.approx(3.0)
    pred[:, :, 0] = 1.0  # right for h=1
    assert float(delta_loss(pred, x, (1, 3))) == pytest.approx(9 / 4)
    assert float(delta_loss(pred[:, :1], x[:, :1], (3,))) == 0.0  # T=1 (images): no valid pair


def test_future_delta_head_shapes_and_training_only() -> None:
    head = FutureDeltaHead(d=16, d_v=20, patches=5, horizons=(3,), heads=4)
    assert head(torch.randn(6, 2, 16)).shape == (6, 1, 5, 20)
    assert isinstance(head.norm, nn.LayerNorm) and head.out.out_features == 20


def test_vtm_and_vtc_hand_computed() -> None:
    scores = torch.tensor([[2.0, 0.0, 0.0]])
    assert float(vtm_loss(scores)) == pytest.approx(-math.log(math.e**2 / (math.e**2 + 2)))
    t = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # normalised: [1,0], [.707,.707]
    c = 1 / math.sqrt(2)
    row0 = -math.log(math.exp(20) / (math.exp(20) + math.exp(20 * c)))
    row1 = -math.log(math.exp(20 * c) / (math.exp(0) + math.exp(20 * c)))
    col0 = -math.log(math.exp(20) / (math.exp(20) + math.exp(0)))
    col1 = -math.log(math.exp(20 * c) / (math.exp(20 * c) + math.exp(20 * c)))
    assert float(vtc_loss(t, v)) == pytest.approx(0.5 * ((row0 + row1) / 2 + (col0 + col1) / 2), rel=1e-5)
    # the same group twice in a batch is not its own negative
    assert float(vtc_loss(t, v, groups=torch.tensor([0, 0]))) == pytest.approx(0.0, abs=1e-6)
    logits = torch.zeros(1, 2, 4)
    assert float(mlm_loss(logits, torch.tensor([[2, -100]]))) == pytest.approx(math.log(4))


def test_cache_structure_loss_hand_computed_and_trains_the_compressor() -> None:
    """Caches [1,0], [1,0], [0,1] (cosines 1, 0, 0) against features whose frame means are [1,0],
    [0,1], [0,1] (cosines 0, 0, 1): squared differences 1, 0, 1 over the three pairs, 2/3."""
    caches = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])
    features = torch.tensor([[[[2.0, 0.0]], [[0.0, 0.0]]], [[[0.0, 1.0]], [[0.0, 3.0]]], [[[0.0, 5.0]], [[0.0, 1.0]]]])
    assert float(cache_structure_loss(caches, features)) == pytest.approx(2 / 3)
    assert float(cache_structure_loss(caches[:1], features[:1])) == 0.0  # one item: no pair
    # through a post-norm compressor whose caches start alike, the term makes them as distinct as the features
    torch.manual_seed(0)
    comp = FrameCompressor(16, 32, tokens_per_frame=4, frames=1, heads=4)
    x = torch.randn(12, 1, 5, 16) + 3.0 * torch.randn(12, 1, 1, 16)  # items differ by a per-item shift
    opt = torch.optim.Adam(comp.parameters(), lr=1e-3)
    first = float(cache_structure_loss(comp(x), x))
    for _ in range(30):
        loss = cache_structure_loss(comp(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(cache_structure_loss(comp(x), x)) < 0.5 * first


def test_score_head_and_prior_follow_eq5(reranker: JointReranker) -> None:
    d = reranker.d
    assert [type(m) for m in reranker.prior] == [nn.Linear, nn.GELU, nn.Linear]
    assert (reranker.prior[0].in_features, reranker.prior[0].out_features, reranker.prior[2].out_features) == (1, 64, d)
    assert [type(m) for m in reranker.head] == [nn.Linear, nn.GELU, nn.Linear]
    assert (reranker.head[0].in_features, reranker.head[0].out_features, reranker.head[2].out_features) == (d, d, 1)
    reranker.eval()
    text = reranker.tokenize(["a person in a red top walks to the left", "two people"])
    cache = torch.randn(2, 6, d)
    rows = torch.tensor([0, 1])
    with torch.no_grad():
        s = reranker.score(text, rows, cache, torch.tensor([0.1, 0.2]))
        c = reranker._encode(text.ids, text.mask, cache)[:, 0]
        manual = reranker.head(c + reranker.prior(torch.tensor([[0.1], [0.2]]))).squeeze(-1)
        assert torch.allclose(s, manual, atol=1e-6)
        # learned positions cover the cache: reordering cached tokens changes the score
        assert not torch.allclose(reranker.score(text, rows, cache[:, [3, 4, 5, 0, 1, 2]], torch.tensor([0.1, 0.2])),
                                  s)
        assert not torch.allclose(reranker.score(text, rows, cache, torch.tensor([0.9, 0.2])), s)


def test_mean_readout_averages_unpadded_tokens_and_leaves_the_fast_path(tiny_bert_dir) -> None:
    """The experiment-only readout: c = the mean of the final states of the unpadded text tokens
    and every cache token (the padded one excluded, by hand); the [CLS]-only fast path, which
    cannot compute it, is refused so scoring falls back to the reference forward."""
    bert, tok = load_bert(str(tiny_bert_dir))
    reranker = JointReranker(bert, tok, item_dim=12, max_text_tokens=16, readout="mean").eval()
    text = reranker.tokenize(["a person in a red top walks to the left", "two people"])
    cache = torch.randn(2, 3, reranker.d)
    with torch.no_grad():
        c = reranker.joint_state(text, torch.tensor([0, 1]), cache)
        hidden = reranker._encode(text.ids, text.mask, cache)
        n_short = int(text.mask[1].sum())
        assert n_short < text.ids.shape[1]  # the second caption is padded
        manual = torch.stack([hidden[0].mean(0), torch.cat([hidden[1, :n_short], hidden[1, -3:]]).mean(0)])
        assert torch.allclose(c, manual, atol=1e-6)
    assert not reranker.fast_scoring_supported() and not onnx_scoring.onnx_scoring_supported(reranker)
    with pytest.raises(ValueError, match="readout"):
        reranker.score_embedded(torch.zeros(1, 2, reranker.d), torch.ones(1, 2, dtype=torch.long),
                                torch.tensor([0]), cache[:1], torch.zeros(1))
    reranker.readout = "cls"
    assert reranker.fast_scoring_supported()


def test_encoder_dropout_sets_every_dropout_and_is_off_in_eval(tiny_bert_dir) -> None:
    """``dropout`` reaches every dropout of the encoder (embeddings, attention, hidden states) and
    its config; train mode then changes the scores (noise), eval mode never does; None keeps the
    encoder's own; outside [0, 1) it is refused."""
    bert, tok = load_bert(str(tiny_bert_dir))
    own = {m.p for m in bert.modules() if isinstance(m, nn.Dropout)}
    kept = JointReranker(bert, tok, item_dim=12, max_text_tokens=16)
    assert {m.p for m in kept.bert.modules() if isinstance(m, nn.Dropout)} == own
    bert, tok = load_bert(str(tiny_bert_dir))
    reranker = JointReranker(bert, tok, item_dim=12, max_text_tokens=16, dropout=0.5)
    drops = [m for m in reranker.bert.modules() if isinstance(m, nn.Dropout)]
    assert drops and {m.p for m in drops} == {0.5}
    assert bert.config.hidden_dropout_prob == bert.config.attention_probs_dropout_prob == 0.5
    text = reranker.tokenize(["a person walking to the left"])
    cache, rows, rho = torch.randn(1, 3, reranker.d), torch.tensor([0]), torch.zeros(1)
    with torch.no_grad():
        reranker.train()
        noisy = {float(reranker.score(text, rows, cache, rho)) for _ in range(4)}
        reranker.eval()
        clean = {float(reranker.score(text, rows, cache, rho)) for _ in range(4)}
    assert len(noisy) > 1 and len(clean) == 1
    with pytest.raises(ValueError, match="dropout"):
        JointReranker(bert, tok, item_dim=12, max_text_tokens=16, dropout=1.0)


def test_mlm_masking_targets_only_words(reranker: JointReranker) -> None:
    text = reranker.tokenize(["a person in a red top walks to the left of the path"] * 4)
    ids, labels = reranker.mask_tokens(text, torch.Generator().manual_seed(0), share=0.5)
    special = set(reranker.tokenizer.all_special_ids)
    targets = labels != -100
    assert targets.any(dim=1).all()
    assert all(int(t) not in special for t in text.ids[targets])
    assert torch.equal(ids[~targets], text.ids[~targets])
    reranker.eval()  # no dropout: the two calls below must see the same encoder
    cache = torch.randn(4, 3, reranker.d)
    logits = reranker.mlm_logits(ids, text.mask, cache)
    assert logits.shape == (*ids.shape, len(reranker.tokenizer))
    # training asks for the targets' rows alone: the same logits and so the same loss
    at_targets = reranker.mlm_logits(ids, text.mask, cache, at=targets)
    assert at_targets.shape == (int(targets.sum()), len(reranker.tokenizer))
    torch.testing.assert_close(at_targets, logits[targets], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlm_loss(at_targets, labels[targets]), mlm_loss(logits, labels), rtol=1e-5, atol=1e-6)


def test_bf16_cache_payload_is_exactly_2tmd_bytes(tmp_path) -> None:
    """T=16, M=4, d=384 → 49,152 bytes (48 KiB); M=1 → 12,288 (App. A.2)."""
    for m, expected in ((4, 49_152), (1, 12_288)):
        z = np.random.default_rng(0).standard_normal((2, 16 * m, 384)).astype(np.float32)
        table = cache_rows(["a", "b"], z, 16, m, "bf16")
        assert table.column("payload_bytes").to_pylist() == [expected] * 2
        assert [len(b) for b in table.column("cache").to_pylist()] == [expected] * 2
    fp4 = cache_rows(["a"], z[:1], 16, 1, "fp4")
    assert fp4.column("payload_bytes")[0].as_py() == 16 * 384 // 2


def test_cache_index_checks_lineage_and_decodes(tmp_path) -> None:
    z = np.random.default_rng(1).standard_normal((3, 8, 16)).astype(np.float32)
    lineage = {"backbone": {"model_id": "b"}, "compressor": "abc", "frames": 4, "tokens_per_frame": 2, "dim": 16}
    writer = ArtifactWriter(str(tmp_path / "cache"), "vedje_cache", cache_rows(["x", "y", "z"], z, 4, 2, "bf16").schema,
                            "k")
    writer.begin()
    shard = writer.write_shard(0, cache_rows(["x", "y", "z"], z, 4, 2, "bf16"))
    writer.finalize([shard], code_version="t", config={"cache_lineage": lineage})
    index = CacheIndex(str(tmp_path / "cache"), lineage)
    got = index.fetch(["z", "x"])
    assert got.dtype == torch.float32 and got.shape == (2, 8, 16)
    assert torch.allclose(got[1], torch.from_numpy(z[0]), atol=0.02)
    assert index.stats.bytes == 2 * 2 * 8 * 16
    with pytest.raises(CacheLineageError, match=r"compressor weights.*index-cache"):
        CacheIndex(str(tmp_path / "cache"), {**lineage, "compressor": "new"})
    with pytest.raises(CacheLineageError, match="visual backbone"):
        check_lineage(lineage, {**lineage, "backbone": {"model_id": "other"}}, "here")
    with pytest.raises(KeyError, match="no cache"):
        index.fetch(["missing"])


def test_fingerprint_tracks_compressor_only(reranker: JointReranker) -> None:
    model = Vedje(VedjeShape(d_v=20, patches=5, frames=4, tokens_per_frame=2, horizons=(3,), heads=4), reranker)
    before = model.compressor_fingerprint()
    with torch.no_grad():
        model.reranker.head[0].weight.add_(1.0)  # a joint-encoder update keeps caches valid
    assert model.compressor_fingerprint() == before
    with torch.no_grad():
        model.compressor.queries.add_(1.0)
    assert model.compressor_fingerprint() != before
    assert model.delta_head is not None
    # the option added later leaves the fingerprints of post-norm (default) caches as they were
    shape = VedjeShape(d_v=20, patches=5, frames=4, tokens_per_frame=2, horizons=(3,), heads=4)
    old = {k: v for k, v in asdict(shape).items() if k not in ("compressor_norm", "patch_positions")}
    h = hashlib.sha256(repr(sorted(old.items())).encode())
    for name, tensor in sorted(model.compressor.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    assert model.compressor_fingerprint() == h.hexdigest()
    pre = Vedje(VedjeShape(d_v=20, patches=5, frames=4, tokens_per_frame=2, heads=4, compressor_norm="pre"), reranker)
    assert pre.compressor_fingerprint() != model.compressor_fingerprint()
    placed = Vedje(VedjeShape(d_v=20, patches=5, frames=4, tokens_per_frame=2, horizons=(3,), heads=4,
                              patch_positions=True), reranker)
    placed.compressor.load_state_dict(model.compressor.state_dict())  # same weights: only the option differs
    assert placed.compressor_fingerprint() != model.compressor_fingerprint()
    image_model = Vedje(VedjeShape(d_v=20, patches=5, frames=1, heads=4), reranker)
    assert image_model.delta_head is None  # T=1: no (t, t+h) pair, no delta head
    with pytest.raises(ValueError, match="per-frame"):
        Vedje(VedjeShape(d_v=20, patches=5, frames=4, structure="mean", heads=4), reranker)


def test_patch_positions_make_the_compressor_see_where_a_patch_is() -> None:
    """The sinusoidal code, hand-computed for d = 4: rates 10000^(-0/4) = 1 and 10000^(-2/4) = 0.01,
    so patch p gets [sin p, cos p, sin 0.01p, cos 0.01p]. Without it the compressor's cross-attention
    reads the patches as a set (a permutation of the patches leaves Z unchanged); with it, it does not."""
    code = patch_positions(3, 4)
    expected = torch.tensor([[math.sin(p), math.cos(p), math.sin(0.01 * p), math.cos(0.01 * p)] for p in range(3)])
    torch.testing.assert_close(code, expected, rtol=0, atol=1e-6)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 10)
    swapped = x[:, :, torch.tensor([5, 4, 3, 2, 1, 0])]
    as_set = FrameCompressor(10, 16, tokens_per_frame=2, frames=3, layers=1, heads=4, dropout=0.0).eval()
    placed = FrameCompressor(10, 16, tokens_per_frame=2, frames=3, layers=1, heads=4, dropout=0.0, patches=6).eval()
    placed.load_state_dict(as_set.state_dict())  # the code is a fixed buffer, not a weight
    with torch.no_grad():
        torch.testing.assert_close(as_set.frame_tokens(swapped), as_set.frame_tokens(x), rtol=1e-5, atol=1e-5)
        assert (placed.frame_tokens(swapped) - placed.frame_tokens(x)).abs().max() > 1e-2
        # the code is exactly what is added to the memory: the same weights with it added by hand agree
        shifted = as_set.kv_proj(x.reshape(6, 6, 10)) + patch_positions(6, 16)
        by_hand = as_set.decoder(as_set.queries.unsqueeze(0).expand(6, -1, -1), shifted).reshape(2, 3, 2, 16)
        torch.testing.assert_close(placed.frame_tokens(x), by_hand, rtol=1e-5, atol=1e-5)


def test_learning_rate_schedule() -> None:
    """App. A.3: 400 warmup steps 1e-6 → 3e-4, then ×0.9 per epoch."""
    cfg = VedjeTrainConfig()
    assert learning_rate(cfg, 0, 0) == pytest.approx(1e-6)
    assert learning_rate(cfg, 200, 0) == pytest.approx(1e-6 + (3e-4 - 1e-6) / 2)
    assert learning_rate(cfg, 400, 1) == pytest.approx(3e-4 * 0.9)
    assert learning_rate(cfg, 900, 3) == pytest.approx(3e-4 * 0.9**3)


def test_recall_and_hard_negatives() -> None:
    from rde.vedje.data import negatives_for
    from rde.vedje.training import recall_at
    from tasks.vedje.rerank import _recall_rows

    assert recall_at([["a", "b"], ["c", "a"], ["b", "c"]], ["a", "a", "a"], 1) == pytest.approx(100 / 3)
    assert recall_at([["a", "b"], ["c", "a"], ["b", "c"]], ["a", "a", "a"], 2) == pytest.approx(200 / 3)
    groups = ["g0", "g0", "g1", "g2", "g3"]
    ranked = np.array([1, 2, 0, 3, 4])
    drawn = negatives_for(7, ranked, groups, "g0", 2, seed=0, step=3)
    assert len(drawn) == 2 and set(drawn) <= {2, 3, 4}  # never the query's own group
    assert drawn == negatives_for(7, ranked, groups, "g0", 2, seed=0, step=3)  # seeded
    assert negatives_for(7, ranked, groups, "g0", 5, seed=0, step=3) == [2, 3, 4]
    # rows written by `rerank`: query 0's relevant item is stage-1 rank 2 but the reranker puts it first
    out = [{"query_id": 0, "stage1_rank": r, "score": s, "relevant": r == 2} for r, s in ((0, 0.1), (1, 0.2), (2, 0.9))]
    rows = {(r["ranking"], r["n_candidates"], r["metric"]): r["value"] for r in _recall_rows(out, 1, 3, [2, 3])}
    assert rows[("stage-1", 3, "R@1")] == 0.0 and rows[("rerank", 3, "R@1")] == 100.0
    assert rows[("rerank", 2, "R@1")] == 0.0  # with N_c = 2 the relevant item is not a candidate


def test_cache_positions_do_not_depend_on_the_query_length(reranker: JointReranker) -> None:
    """Cached token k sits at position max_text_tokens + k: a pair scores the same alone or batched
    with a longer query (padding must not shift the temporal layout)."""
    reranker.eval()
    cache = torch.randn(1, 4, reranker.d)
    with torch.no_grad():
        alone = reranker.score(reranker.tokenize(["a person"]), torch.tensor([0]), cache, torch.tensor([0.3]))
        batch = reranker.tokenize(["a person", "a person in a red top and blue trousers walks to the left"])
        together = reranker.score(batch, torch.tensor([0, 1]), cache.expand(2, -1, -1), torch.tensor([0.3, 0.3]))
    assert torch.allclose(alone, together[:1], atol=1e-5)


def _spread_head(reranker: JointReranker) -> None:
    """A head with weights large enough that the scores of different caches clearly differ
    (at initialisation they agree to ~1e-2, which would make any tolerance test vacuous)."""
    torch.manual_seed(3)
    for layer in (reranker.head[0], reranker.head[2]):
        nn.init.normal_(layer.weight, std=1.0)


@pytest.mark.parametrize("encoder", ["tiny", "minilm-3"])
def test_fast_and_onnx_scoring_equal_the_reference_forward(encoder: str, tiny_bert_dir) -> None:
    """The serving paths (``score_fast``: shared text work, fused query/key/value, [CLS]-only last
    block with folded keys and values; ``score_onnx``: that graph in ONNX Runtime) give the reference
    forward's scores within atol 1e-4 (FP32 rounding only) and the same order, for one unpadded query
    (the ``rerank`` case) and for padded queries sharing a batch; one exported graph serves every
    shape (queries, text length, pairs, cached tokens)."""
    from models.reranker.joint_encoder import BUNDLED_MINILM
    from models.reranker.onnx_scoring import scorer_for

    bert, tok = load_bert(str(tiny_bert_dir)) if encoder == "tiny" else load_bert(BUNDLED_MINILM, layers=3)
    rr = JointReranker(bert, tok, item_dim=12, max_text_tokens=16).eval()
    _spread_head(rr)
    assert rr.fast_scoring_supported() and onnx_scoring.onnx_scoring_supported(rr)
    # data whose scores are far apart within each query: seed 75's smallest gap is 7.8e-3 · max(1,
    # |score|) over both encoders, 3.9 × the order check's margin below (seed 0's was 1.8e-5)
    g = torch.Generator().manual_seed(75)
    for texts, rows, k in ((["a person in a red top walks to the left"], [0] * 7, 8),
                           (["a man", "two people in dark coats walk right together", "red"], [0, 1, 2, 1, 0, 2, 1], 8),
                           (["a car", "a person with a bag"], [1, 0, 0], 3)):
        text = rr.tokenize(texts)
        cache = torch.randn(len(rows), k, rr.d, generator=g)
        rho = torch.rand(len(rows), generator=g)
        with torch.no_grad():
            ref = rr.score(text, torch.tensor(rows), cache, rho)
        with torch.inference_mode():
            fast = rr.score_fast(text, torch.tensor(rows), cache, rho)
            onnx = onnx_scoring.score_onnx(rr, text, torch.tensor(rows), cache, rho)
            graph = rr.fast_scores(rr.bert.embeddings.word_embeddings(text.ids), text.mask, torch.tensor(rows), cache,
                                   rho, always_mask=True)  # what is exported, run by PyTorch
        assert float(ref.std()) > 0.05
        torch.testing.assert_close(graph, ref, atol=1e-4, rtol=1e-4)
        # the same order as the reference, asked only once no two scores of a query are within 10 × the
        # tolerance (atol + rtol·|score| ≤ 2e-4 · max(1, |score|)): no CPU's kernels can swap them then
        queries = [torch.tensor(rows) == q for q in range(len(texts))]
        ref_order = [torch.from_numpy(unambiguous_top(ref[m].numpy()[None], int(m.sum()) - 1, margin=10 * 2e-4)[0])
                     for m in queries]
        for got in (fast, onnx):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            order = [torch.argsort(got[m], descending=True, stable=True)[:-1] for m in queries]
            assert all(torch.equal(a, b) for a, b in zip(order, ref_order, strict=True))
    scorer = scorer_for(rr)
    assert scorer is not None and scorer_for(rr) is scorer  # really ONNX Runtime, exported once, not per call
    too_long = torch.zeros(1, rr.max_positions, rr.d)
    for score in (rr.score_fast, partial(onnx_scoring.score_onnx, rr)):
        with pytest.raises(ValueError, match="positions"), torch.inference_mode():
            score(rr.tokenize(["a man"]), torch.tensor([0]), too_long, torch.rand(1))


def test_onnx_scorer_follows_the_weights(reranker: JointReranker, caplog) -> None:
    """The exported graph is rebuilt when the weights change (loaded or trained in place) or the
    thread count does; a failed export falls back to ``score_fast`` with one warning; a copy of the
    reranker does not share (or pickle) the session."""
    import copy
    import pickle

    from models.reranker.onnx_scoring import scorer_for

    _spread_head(reranker)
    reranker.eval()
    text = reranker.tokenize(["a person walks to the left"])
    g = torch.Generator().manual_seed(2)
    rows, cache, rho = torch.zeros(4, dtype=torch.long), torch.randn(4, 8, reranker.d, generator=g), torch.rand(4)
    with torch.inference_mode():
        before = onnx_scoring.score_onnx(reranker, text, rows, cache, rho)
    first = scorer_for(reranker)
    with torch.no_grad():
        reranker.head[2].weight.mul_(-2.0)  # in place, like an optimiser step or load_state_dict
        ref = reranker.score(text, rows, cache, rho)
    with torch.inference_mode():
        after = onnx_scoring.score_onnx(reranker, text, rows, cache, rho)
    assert scorer_for(reranker) is not first
    torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(after, before, atol=1e-3)
    current, old = scorer_for(reranker), torch.get_num_threads()
    other = 2 if old == 1 else 1  # another count than this process's (an earlier test may have set 1)
    try:
        torch.set_num_threads(other)
        changed = scorer_for(reranker)
        assert changed is not current and changed.session.get_session_options().intra_op_num_threads == other
    finally:
        torch.set_num_threads(old)

    def broken(*a, **k):
        raise RuntimeError("exporter gone")

    reranker.__dict__.pop("_onnx_slot")
    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING"):
        mp.setattr(onnx_scoring, "OnnxScorer", broken)
        with torch.inference_mode():  # falls back to score_fast, says why once
            torch.testing.assert_close(onnx_scoring.score_onnx(reranker, text, rows, cache, rho), ref,
                                       atol=1e-4, rtol=1e-4)
            onnx_scoring.score_onnx(reranker, text, rows, cache, rho)
    assert [r.getMessage() for r in caplog.records].count(
        "ONNX Runtime scoring unavailable (RuntimeError: exporter gone); scoring with score_fast in PyTorch") == 1
    reranker.__dict__.pop("_onnx_slot")
    assert scorer_for(reranker) is not None
    twin = copy.deepcopy(reranker)
    assert pickle.loads(pickle.dumps(twin))._onnx_slot.scorer is None
    with torch.inference_mode():
        torch.testing.assert_close(onnx_scoring.score_onnx(twin, text, rows, cache, rho), after)
    assert scorer_for(twin) is not scorer_for(reranker)


def test_joint_scores_paths_agree_and_fall_back(reranker: JointReranker, monkeypatch) -> None:
    """``joint_scores`` (what ``rerank`` calls): paths 'onnx' (the default) and 'fast' = path
    'reference' within atol 1e-4, chunked or not; without onnxruntime 'onnx' runs 'fast', and an
    encoder the fast path cannot read is scored by the reference forward."""
    import models.reranker.onnx_scoring
    import rde.vedje.training
    from rde.vedje.config import VedjeSpec
    from rde.vedje.training import SCORE_PATHS, joint_scores

    assert VedjeSpec().score_path == "onnx" and set(SCORE_PATHS) == {"onnx", "fast", "reference"}  # rerank's path
    _spread_head(reranker)
    model = Vedje(VedjeShape(d_v=20, patches=5, frames=4, tokens_per_frame=2, heads=4), reranker)
    g = torch.Generator().manual_seed(1)
    caches, rho = torch.randn(6, 8, reranker.d, generator=g), torch.rand(10, generator=g)
    pairs = [(q, c) for q in range(2) for c in (0, 2, 4, 5, 1)]
    texts = ["a person walks to the left", "a car"]
    ref = joint_scores(model, texts, pairs, caches, rho, path="reference")
    for path in ("onnx", "fast"):
        for batch in (256, 3):
            np.testing.assert_allclose(joint_scores(model, texts, pairs, caches, rho, batch, path), ref,
                                       atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="one of 'onnx', 'fast', 'reference'"):
        joint_scores(model, texts, pairs, caches, rho, path="int8")
    assert models.reranker.onnx_scoring.scorer_for(reranker) is not None  # 'onnx' ran in ONNX Runtime
    fast = joint_scores(model, texts, pairs, caches, rho, path="fast")
    monkeypatch.setattr(models.reranker.onnx_scoring, "runtime_available", lambda: False)
    monkeypatch.setattr(rde.vedje.training, "score_onnx", lambda *a: pytest.fail("onnx path used without onnxruntime"))
    np.testing.assert_allclose(joint_scores(model, texts, pairs, caches, rho), fast, atol=0)
    monkeypatch.setattr(JointReranker, "fast_scoring_supported", lambda self: False)
    monkeypatch.setattr(JointReranker, "score_fast", lambda *a: pytest.fail("fast path used on an unsupported encoder"))
    np.testing.assert_allclose(joint_scores(model, texts, pairs, caches, rho), ref, atol=0)

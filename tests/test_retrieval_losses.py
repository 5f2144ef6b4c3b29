"""SAFT and GTR+ losses on a 3×3 batch against values computed by hand (numpy, straight from the
equations), including the KL direction conventions; GMM confidence against scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.retrieval.losses import (
    cusa_loss,
    hard_negative_itc,
    isd_loss,
    iss_loss,
    itc_loss,
    saft_loss,
    sass_loss,
    weighted_itm_loss,
)
from rde.training.gmm_confidence import (
    clean_confidence,
    combined_score,
    confidence_weights,
    fit_gmm_1d,
    pair_confidence,
)


def _unit(rows: list[list[float]]) -> np.ndarray:
    a = np.array(rows, np.float64)
    return a / np.linalg.norm(a, axis=1, keepdims=True)


IMG = _unit([[1.0, 0.2, 0.0], [0.1, 1.0, 0.3], [0.0, 0.4, 1.0]])
TXT = _unit([[0.9, 0.1, 0.2], [0.3, 1.0, 0.0], [0.2, 0.0, 1.0]])
T_IMG = _unit([[1.0, 0.0, 0.1], [0.2, 1.0, 0.1], [0.0, 0.3, 1.0]])
T_TXT = _unit([[1.0, 0.3, 0.0], [0.0, 1.0, 0.2], [0.1, 0.1, 1.0]])
TAU, TAU_O = 0.1, 0.05


def _softmax_rows(m: np.ndarray) -> np.ndarray:
    e = np.exp(m - m.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """Mean over rows of Σ_j p_j log(p_j / q_j)."""
    return float(np.mean(np.sum(p * np.log(p / q), axis=1)))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


def test_itc_matches_equations_3_and_4() -> None:
    p_i2t = _softmax_rows(IMG @ TXT.T / TAU)  # p_ij
    p_t2i = _softmax_rows(TXT @ IMG.T / TAU)  # p_ji
    expected = -(np.log(np.diag(p_i2t)).sum() + np.log(np.diag(p_t2i)).sum()) / (2 * 3)
    assert itc_loss(_t(IMG), _t(TXT), TAU).item() == pytest.approx(expected, rel=1e-9)
    w = np.array([1.0, 0.5, 0.0])
    weighted = -(w * (np.log(np.diag(p_i2t)) + np.log(np.diag(p_t2i)))).sum() / (2 * 3)
    assert itc_loss(_t(IMG), _t(TXT), TAU, _t(w)).item() == pytest.approx(weighted, rel=1e-9)


def test_sass_is_the_bidirectional_kl_of_equation_6() -> None:
    s_i2t, s_t2i = _softmax_rows(IMG @ TXT.T / TAU), _softmax_rows(TXT @ IMG.T / TAU)
    t_i2t, t_t2i = _softmax_rows(T_IMG @ T_TXT.T / TAU_O), _softmax_rows(T_TXT @ T_IMG.T / TAU_O)
    expected = (_kl(t_i2t, s_i2t) + _kl(t_t2i, s_t2i) + _kl(s_i2t, t_i2t) + _kl(s_t2i, t_t2i)) / 4
    got = sass_loss(_t(IMG), _t(TXT), TAU, _t(T_IMG), _t(T_TXT), TAU_O).item()
    assert got == pytest.approx(expected, rel=1e-9)
    forward_only = (_kl(t_i2t, s_i2t) + _kl(t_t2i, s_t2i)) / 2
    assert abs(got - forward_only) > 1e-3  # the reverse direction really is in (KL is asymmetric)
    assert sass_loss(_t(IMG), _t(TXT), TAU, _t(IMG), _t(TXT), TAU).item() == pytest.approx(0.0, abs=1e-12)


def test_isd_is_kl_teacher_to_student_over_image_image_softmaxes() -> None:
    t_v2v, s_v2v = _softmax_rows(T_IMG @ T_IMG.T / TAU_O), _softmax_rows(IMG @ IMG.T / TAU)
    got = isd_loss(_t(IMG), TAU, _t(T_IMG), TAU_O).item()
    assert got == pytest.approx(_kl(t_v2v, s_v2v), rel=1e-9)
    assert got != pytest.approx(_kl(s_v2v, t_v2v), rel=1e-3)  # direction: KL(T‖S), not KL(S‖T)


def test_saft_total_is_itc_plus_weighted_terms_with_paper_defaults() -> None:
    out = saft_loss(_t(IMG), _t(TXT), TAU, _t(T_IMG), _t(T_TXT), TAU_O)
    assert out["total"].item() == pytest.approx((out["itc"] + 1.0 * out["sass"] + 0.75 * out["isd"]).item())
    # the fused pass gives the same terms as the separate functions
    assert out["itc"].item() == pytest.approx(itc_loss(_t(IMG), _t(TXT), TAU).item(), rel=1e-9)
    assert out["sass"].item() == pytest.approx(sass_loss(_t(IMG), _t(TXT), TAU, _t(T_IMG), _t(T_TXT), TAU_O).item(),
                                               rel=1e-9)
    assert out["isd"].item() == pytest.approx(isd_loss(_t(IMG), TAU, _t(T_IMG), TAU_O).item(), rel=1e-9)


def test_cusa_uses_unimodal_teacher_targets() -> None:
    s_i2t, s_t2i = _softmax_rows(IMG @ TXT.T / TAU), _softmax_rows(TXT @ IMG.T / TAU)
    t_v, t_t = _softmax_rows(T_IMG @ T_IMG.T / TAU_O), _softmax_rows(T_TXT @ T_TXT.T / TAU_O)
    expected = (_kl(t_v, s_i2t) + _kl(t_t, s_t2i)) / 2
    assert cusa_loss(_t(IMG), _t(TXT), TAU, _t(T_IMG), _t(T_TXT), TAU_O).item() == pytest.approx(expected)


def test_hard_negative_threshold_drops_presumed_false_negatives() -> None:
    margin = 0.0
    # query 0: keep negatives with cos ≤ cos(q0, t0) + margin, then the top-1 of them
    losses = []
    for q, t in ((IMG, TXT), (TXT, IMG)):
        s = q @ t.T
        row_losses = []
        for i in range(3):
            negs = [s[i, j] for j in range(3) if j != i and s[i, j] <= s[i, i] + margin]
            negs = sorted(negs, reverse=True)[:1]
            logits = np.array([s[i, i], *negs]) / TAU
            row_losses.append(-(logits[0] - np.log(np.exp(logits).sum())))
        losses.append(np.mean(row_losses))
    assert hard_negative_itc(_t(IMG), _t(TXT), TAU, margin, top_k=1).item() == pytest.approx(np.mean(losses))


# -- by hand on 2×2 / 3×3 batches (plain arithmetic, no numpy): unit vectors whose cosines are 0, 0.6, 0.8 or 1 --
# With two candidates, -log softmax(x)[0] = log(1 + e^(x1 - x0)) =: sp(x1 - x0).
# Tolerance: 1e-9 relative (float64 throughout); the hand-written decimals to 1e-6.

def _sp(x: float) -> float:
    return math.log1p(math.exp(x))


A2 = [[1.0, 0.0], [0.0, 1.0]]  # view a / images
B2 = [[0.6, 0.8], [0.0, 1.0]]  # view b / texts: cos(a_i, b_j) = [[0.6, 0.0], [0.8, 1.0]]


def test_iss_by_hand_is_infonce_between_the_two_views_both_ways() -> None:
    """τ = 0.5: logits [[1.2, 0], [1.6, 2]]. a→b rows: sp(0 − 1.2) = 0.263282, sp(1.6 − 2) = 0.513015;
    b→a (the columns): sp(1.6 − 1.2) = 0.913015, sp(0 − 2) = 0.126928; ISS = their mean = 0.454060."""
    expected = (_sp(-1.2) + _sp(-0.4) + _sp(0.4) + _sp(-2.0)) / 4
    assert expected == pytest.approx(0.454060, abs=1e-6)
    a, b = torch.tensor(A2, dtype=torch.float64), torch.tensor(B2, dtype=torch.float64)
    assert iss_loss(a, b, 0.5).item() == pytest.approx(expected, rel=1e-9)
    # one direction only would give (0.263282 + 0.513015) / 2 = 0.388149; a view against itself sp(-2) = 0.126928
    assert abs(iss_loss(a, b, 0.5).item() - (_sp(-1.2) + _sp(-0.4)) / 2) > 0.05
    assert iss_loss(a, a, 0.5).item() == pytest.approx(_sp(-2.0), rel=1e-9)


def _softmax_list(logits: list[float]) -> list[float]:
    e = [math.exp(x) for x in logits]
    return [x / sum(e) for x in e]


def _kl_list(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_cusa_by_hand_targets_are_the_teachers_unimodal_softmaxes() -> None:
    """3×3 (a 2×2 batch cannot tell the image-image target from the text-text one: swapping them leaves
    the 2×2 value unchanged), τ = τ_o = 0.5. Student images e1, e2, e3, texts (0.6,0.8,0), (0,0.6,0.8), (0,0,1):
    cos = [[0.6, 0, 0], [0.8, 0.6, 0], [0, 0.8, 1]]; i2t rows are softmax(row / 0.5), t2i rows softmax(column / 0.5).
    Teacher images (1,0,0), (0.6,0.8,0), (0,0,1): image-image cos [[1, .6, 0], [.6, 1, 0], [0, 0, 1]] → target rows
    (0.631049, 0.283548, 0.085403), its mirror, (0.106507, 0.106507, 0.786986); teacher texts e1, e2, e3:
    text-text cos = I → rows with 0.786986 on the diagonal, 0.106507 off it.
    i2t: mean KL(image target ‖ i2t) = 0.131786; t2i: mean KL(text target ‖ t2i) = 0.297837; CUSA = 0.214812.
    Targets swapped would give 0.220439, KL(student ‖ target) 0.271387."""
    cos = [[0.6, 0.0, 0.0], [0.8, 0.6, 0.0], [0.0, 0.8, 1.0]]
    i2t = [_softmax_list([c / 0.5 for c in row]) for row in cos]
    t2i = [_softmax_list([cos[i][j] / 0.5 for i in range(3)]) for j in range(3)]
    t_img = [_softmax_list([c / 0.5 for c in row]) for row in ([1.0, 0.6, 0.0], [0.6, 1.0, 0.0], [0.0, 0.0, 1.0])]
    t_txt = [_softmax_list([2.0 if i == j else 0.0 for j in range(3)]) for i in range(3)]
    assert t_img[0] == pytest.approx([0.631049, 0.283548, 0.085403], abs=1e-6)
    assert t_txt[0] == pytest.approx([0.786986, 0.106507, 0.106507], abs=1e-6)
    by_rows = sum(_kl_list(p, q) for p, q in zip(t_img, i2t, strict=True)) / 3
    by_columns = sum(_kl_list(p, q) for p, q in zip(t_txt, t2i, strict=True)) / 3
    expected = (by_rows + by_columns) / 2
    assert (by_rows, by_columns, expected) == pytest.approx((0.131786, 0.297837, 0.214812), abs=1e-6)
    f = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    got = cusa_loss(f([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]), f([[0.6, 0.8, 0.0], [0.0, 0.6, 0.8], [0.0, 0.0, 1.0]]),
                    0.5, f([[1.0, 0, 0], [0.6, 0.8, 0], [0, 0, 1.0]]), f([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]),
                    0.5).item()
    assert got == pytest.approx(expected, rel=1e-9)


def test_hard_negative_mining_by_hand_drops_then_takes_the_top_k() -> None:
    """Images e1, e2, e3 and texts (0.6,0.8,0), (0,0.6,0.8), (0.8,0,0.6): cos = [[0.6, 0, 0.8],
    [0.8, 0.6, 0], [0, 0.8, 0.6]]; every query, either way, has its positive at 0.6 and negatives 0.8 and 0. τ = 0.2.
    margin 0: 0.8 > 0.6 is a presumed false negative, dropped; the one left is 0 → sp(−3) = 0.048587.
    margin 0.25 (α = 0.85): both kept, top-1 is 0.8 → sp(1) = 1.313262.
    margin 0.25, top-2: every negative, plain ITC: log(1 + e^−3 + e^1) = 1.326563."""
    img = torch.eye(3, dtype=torch.float64)
    txt = torch.tensor([[0.6, 0.8, 0.0], [0.0, 0.6, 0.8], [0.8, 0.0, 0.6]], dtype=torch.float64)
    itc = math.log(1 + math.exp(-3.0) + math.exp(1.0))
    assert (_sp(-3.0), _sp(1.0), itc) == pytest.approx((0.048587, 1.313262, 1.326563), abs=1e-6)
    assert hard_negative_itc(img, txt, 0.2, 0.0, top_k=1).item() == pytest.approx(_sp(-3.0), rel=1e-9)
    assert hard_negative_itc(img, txt, 0.2, 0.0, top_k=2).item() == pytest.approx(_sp(-3.0), rel=1e-9)
    assert hard_negative_itc(img, txt, 0.2, 0.25, top_k=1).item() == pytest.approx(_sp(1.0), rel=1e-9)
    assert hard_negative_itc(img, txt, 0.2, 0.25, top_k=2).item() == pytest.approx(itc, rel=1e-9)
    assert itc_loss(img, txt, 0.2).item() == pytest.approx(itc, rel=1e-9)


def test_itm_weights_apply_to_positive_pairs_only() -> None:
    logits = _t(np.array([[0.2, 1.0], [1.5, -0.5], [0.0, 0.3]]))
    labels = torch.tensor([1, 0, 1])
    w = _t(np.array([0.5, 0.1, 1.0]))
    ce = [np.log(np.exp([0.2, 1.0]).sum()) - 1.0, np.log(np.exp([1.5, -0.5]).sum()) - 1.5,
          np.log(np.exp([0.0, 0.3]).sum()) - 0.3]
    expected = (0.5 * ce[0] + ce[1] + 1.0 * ce[2]) / 3
    assert weighted_itm_loss(logits, labels, w).item() == pytest.approx(expected)


# -- GTR+ confidence ---------------------------------------------------------------------------------

def test_combined_score_is_eq7_on_the_raw_cosine() -> None:
    """ŝ = γ·s + (1 − γ)·q_txt with s the raw cosine (no rescaling), γ = 0.2; NaN without q_txt."""
    got = combined_score(np.array([1.0, -1.0, 0.0, 0.5]), np.array([0.5, 0.5, 1.0, np.nan]), gamma=0.2)
    assert got[:3] == pytest.approx([0.2 + 0.4, -0.2 + 0.4, 0.0 + 0.8])
    assert np.isnan(got[3])
    assert combined_score(np.array([0.3]), np.array([0.9]))[0] == pytest.approx(0.06 + 0.72)  # default γ = 0.2


def test_pairs_without_q_txt_get_their_own_fit_on_the_cosine() -> None:
    """Two populations, two mixtures: pairs with q_txt are judged on ŝ by a fit on ŝ alone, pairs
    without on s by a fit on s alone; a population too small to fit keeps confidence 1."""
    rng = np.random.default_rng(3)
    n = 400
    cos_q = np.concatenate([rng.normal(0.6, 0.05, n), rng.normal(0.2, 0.05, n // 3)])
    q = np.concatenate([rng.normal(0.8, 0.03, n), rng.normal(0.4, 0.05, n // 3)])
    cos_only = np.concatenate([rng.normal(0.5, 0.04, n // 2), rng.normal(0.1, 0.04, n // 4)])
    cosine = np.concatenate([cos_q, cos_only])
    q_txt = np.concatenate([q, np.full(len(cos_only), np.nan)])
    conf, score, fits = pair_confidence(cosine, q_txt, gamma=0.2, k=2)
    s_hat = 0.2 * cos_q + 0.8 * q
    assert score[: len(cos_q)] == pytest.approx(s_hat) and score[len(cos_q):] == pytest.approx(cos_only)
    assert conf[: len(cos_q)] == pytest.approx(clean_confidence(s_hat, fit_gmm_1d(s_hat)), abs=1e-9)
    assert conf[len(cos_q):] == pytest.approx(clean_confidence(cos_only, fit_gmm_1d(cos_only)), abs=1e-9)
    assert fits.with_q_txt is not None and fits.cosine_only is not None
    # the noisy halves are found in both populations, on their own scales
    assert conf[:n].mean() > 0.9 and conf[n: len(cos_q)].mean() < 0.1
    assert conf[len(cos_q): len(cos_q) + n // 2].mean() > 0.9 and conf[len(cos_q) + n // 2:].mean() < 0.1
    conf_few, _, fits_few = pair_confidence(np.concatenate([cos_q, np.full(5, 0.9)]),
                                            np.concatenate([q, np.full(5, np.nan)]), min_fit_pairs=10)
    assert fits_few.cosine_only is None and conf_few[len(cos_q):] == pytest.approx(np.ones(5))


def test_gmm_matches_scikit_learn_and_posterior_by_hand() -> None:
    from sklearn.mixture import GaussianMixture

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0.35, 0.05, 3000), rng.normal(0.7, 0.08, 7000)])
    ours = fit_gmm_1d(x)
    sk = GaussianMixture(2, tol=1e-6, max_iter=200, random_state=0).fit(x[:, None])
    order = np.argsort(sk.means_.ravel())
    assert np.sort(ours.means) == pytest.approx(sk.means_.ravel()[order], abs=2e-3)
    assert ours.weights[np.argsort(ours.means)] == pytest.approx(sk.weights_[order], abs=5e-3)
    conf = clean_confidence(np.array([0.5]), ours)[0]
    hi, lo = int(np.argmax(ours.means)), int(np.argmin(ours.means))

    def dens(k: int) -> float:
        return ours.weights[k] * np.exp(-(0.5 - ours.means[k]) ** 2 / (2 * ours.variances[k])) \
            / np.sqrt(2 * np.pi * ours.variances[k])

    assert conf == pytest.approx(dens(hi) / (dens(hi) + dens(lo)))
    # the mixture's log-likelihood of a value: log of the two weighted densities' sum
    assert ours.log_likelihood(np.array([0.5]))[0] == pytest.approx(np.log(dens(hi) + dens(lo)))
    assert ours.log_likelihood(x).mean() == pytest.approx(sk.score(x[:, None]), abs=1e-4)
    assert confidence_weights(np.array([0.25, 1.0]), 0.8) == pytest.approx([0.25 ** 0.8, 1.0])
    with pytest.raises(ValueError, match="at least 2"):
        fit_gmm_1d(np.array([0.1]))


def test_person_search_metrics_by_hand() -> None:
    from rde.common.metrics import person_search_metrics

    # query "a": matches at ranks 2 and 4 of 4 → R@1 0, AP = (1/2 + 2/4)/2 = 0.5, INP = 2/4
    # query "b": match at rank 1 → R@1 1, AP 1, INP 1
    sims = np.array([[0.9, 0.8, 0.7, 0.1], [0.2, 0.1, 0.9, 0.3]])
    got = person_search_metrics(sims, ["a", "b"], ["x", "a", "b", "a"], ks=(1, 5))
    assert got == {"R@1": 0.5, "R@5": 1.0, "mAP": pytest.approx(0.75), "mINP": pytest.approx(0.75), "queries": 2.0}


def test_person_search_in_chunks_equals_the_whole_matrix() -> None:
    """Chunks of queries, each with its own number of queries that have a match, give the whole
    matrix's metrics."""
    from rde.common.metrics import person_search_metrics, person_search_over_vectors

    rng = np.random.default_rng(3)
    queries, gallery = rng.standard_normal((23, 6)), rng.standard_normal((17, 6))
    # queries without a match (left out) make the chunks of 5 count 5, 3, 5, 5 and 1 queries
    query_ids = ["nobody" if i in (7, 8, 21, 22) else f"p{i % 5}" for i in range(23)]
    gallery_ids = [f"p{i % 6}" for i in range(17)]
    whole = person_search_metrics(queries @ gallery.T, query_ids, gallery_ids)
    chunked = person_search_over_vectors(queries, query_ids, gallery, gallery_ids, chunk=5)
    assert chunked.keys() == whole.keys() and chunked["queries"] == whole["queries"] == 19.0
    for name, value in whole.items():
        assert chunked[name] == pytest.approx(value, abs=1e-12), name
    assert person_search_over_vectors(queries[:0], [], gallery, gallery_ids)["queries"] == 0.0

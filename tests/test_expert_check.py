"""Metrics by hand, and the offline experts against random on the hand-labelled check set."""

from __future__ import annotations

import numpy as np
import pytest

from rde.common.metrics import average_precision_at_k, mean_ap_at_k
from rde.common.topk import topk_exact


def test_average_precision_at_k_hand_computed() -> None:
    # relevant at ranks 1 and 3, R = 2: (1/1 + 2/3) / min(10, 2)
    assert average_precision_at_k([True, False, True, False], 2, 10) == pytest.approx((1 + 2 / 3) / 2)
    # R = 5 > K = 2, both top-2 relevant: perfect at K, denominator min(K, R) = 2
    assert average_precision_at_k([True, True, False], 5, 2) == pytest.approx(1.0)
    # relevant beyond K does not count
    assert average_precision_at_k([False, False, True], 1, 2) == 0.0
    assert average_precision_at_k([False, True], 0, 10) is None  # no relevant item: no AP
    assert average_precision_at_k([True] * 10, 10, 10) == pytest.approx(1.0)  # all relevant
    assert average_precision_at_k([True] * 3, 3, 10) == pytest.approx(1.0)  # R < K, all found first
    assert mean_ap_at_k([[True], [False, True], []], [1, 1, 0], 10) == pytest.approx((1 + 0.5) / 2)


def test_ranking_breaks_ties_by_gallery_order() -> None:
    q = np.array([[1.0, 0.0]], np.float32)
    g = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    assert topk_exact(q, g, 3)[0].tolist() == [[1, 2, 0]]


def test_score_vectors_hand_computed() -> None:
    """Through the one scoring path: a query with a relevant item at ranks 1 and 3, one at rank 3,
    one with no relevant item (left out)."""
    from rde.evaluation.scoring import means_by_domain, metric_names, score_vectors

    queries = [{"query_id": q, "domain": "d", "text": q} for q in ("q1", "q2", "q3")]
    q = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float32)
    g = np.array([[1, 0, 0], [0.9, 0.1, 0], [0.8, 0, 0.2], [0, 1, 0]], np.float32)
    # q1 ranks a(1.0) x(0.9) b(0.8) y(0.0); q2 ranks y(1.0) x(0.1) a b (ties: gallery order)
    scored = score_vectors(q, queries, g, ["a", "x", "b", "y"], ["d"] * 4, {"q1": {"a", "b"}, "q2": {"b"}, "q3": set()})
    m = means_by_domain(scored, metric_names())["all"]
    assert m["queries"] == 2
    assert m["mAP@10"] == pytest.approx(((1 + 2 / 3) / 2 + (1 / 4) / 1) / 2)
    assert m["R@1"] == pytest.approx(0.5) and m["R@5"] == pytest.approx(1.0)
    assert m["MRR"] == pytest.approx((1 + 1 / 4) / 2) and m["mINP"] == pytest.approx((2 / 3 + 1 / 4) / 2)


def test_score_vectors_ranks_within_the_query_domain() -> None:
    from rde.evaluation.scoring import means_by_domain, metric_names, score_vectors

    q = np.array([[1, 0], [0, 1]], np.float32)
    g = np.array([[1, 0], [0.9, 0.1], [0, 1]], np.float32)
    queries = [{"query_id": "q1", "domain": "pedestrian", "text": "q1"},
               {"query_id": "q2", "domain": "vehicle", "text": "q2"}]
    scored = score_vectors(q, queries, g, ["p1", "v1", "v2"], ["pedestrian", "vehicle", "vehicle"],
                           {"q1": {"p1"}, "q2": {"v1"}})
    res = means_by_domain(scored, metric_names())
    assert res["pedestrian"]["mAP@10"] == 1.0
    assert res["vehicle"]["mAP@10"] == pytest.approx(0.5)  # v2 (cosine 1) outranks v1 (0.1)
    assert res["all"]["queries"] == 2 and res["all"]["R@1"] == pytest.approx(0.5)


# -- the check-set file: validation of its labels and provenance --

PERSON = "vtest.avi#pedestrian-s000-0027"  # an identity of the demo pool
JUNK = "vtest.avi#pedestrian-s000-0001"  # one the check set lists as junk (a tracker swap)


def _query(qid: str = "q01", **over: object) -> dict:
    q = {"id": qid, "text": "a man in a black jacket", "domain": "pedestrian",
         "relevant_identities": [PERSON], "labelled_by": "tester (by eye)", "labelled_on": "2026-12-01"}
    q.update(over)
    return q


def _write(tmp_path, queries: list[dict], junk: list[str] | None = None):
    import yaml

    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "version": "1", "junk_identities": junk or [], "queries": queries}))
    return path


def test_check_yaml_accepts_a_valid_file(tmp_path) -> None:
    from rde.common.expert_check import load_check_yaml

    assert [q["id"] for q in load_check_yaml(_write(tmp_path, [_query("q01"), _query("q02")]))["queries"]] == \
        ["q01", "q02"]


@pytest.mark.parametrize(("queries", "junk", "message"), [
    ([_query("q01"), _query("q01")], None, "query q01: duplicate query id"),
    ([_query("q01"), _query("q02", text="  ")], None, "query q02: empty or missing text"),
    ([_query("q01", domain="Animals!")], None, "query q01: domain must be a domain's name"),
    ([_query("q03", relevant_identities=[])], None, "query q03: no relevant identities"),
    ([_query("q04", labelled_by="")], None, "query q04: missing labelled_by"),
    ([{k: v for k, v in _query("q05").items() if k != "labelled_by"}], None, "query q05: missing labelled_by"),
    ([{k: v for k, v in _query("q06").items() if k != "labelled_on"}], None, "query q06: missing labelled_on"),
    ([_query("q07", labelled_on="1st December")], None, "query q07: labelled_on must be an ISO date"),
    ([_query("q08", relevant_identities=[JUNK, PERSON])], [JUNK],
     "query q08: relevant identities listed as junk: vtest.avi#pedestrian-s000-0001"),
])
def test_check_yaml_rejects_bad_labels_naming_file_and_query(tmp_path, queries, junk, message) -> None:
    from rde.common.expert_check import load_check_yaml

    path = _write(tmp_path, queries, junk)
    with pytest.raises(ValueError, match=r"^check set ") as err:
        load_check_yaml(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_check_yaml_accepts_an_unquoted_yaml_date(tmp_path) -> None:
    from rde.common.expert_check import load_check_yaml

    path = _write(tmp_path, [_query()])
    path.write_text(path.read_text().replace("labelled_on: '2026-12-01'", "labelled_on: 2026-12-01"))
    assert "labelled_on: 2026-12-01\n" in path.read_text()
    load_check_yaml(path)


def test_check_set_rejects_relevant_identities_missing_from_the_pool(tmp_path, demo_pool_url: str) -> None:
    from rde.common.expert_check import load_check_set

    path = _write(tmp_path, [_query("q01"), _query("q02", relevant_identities=[PERSON, "nobody-1"]),
                             _query("q03", relevant_identities=["nobody-2"])])
    with pytest.raises(ValueError, match=r"no \(non-junk\) crop in the pool") as err:
        load_check_set(demo_pool_url, path)
    assert str(path) in str(err.value)
    assert "query q02: nobody-1" in str(err.value) and "query q03: nobody-2" in str(err.value)
    assert "q01" not in str(err.value)


def test_shipped_check_set_has_enough_queries_each_with_provenance(demo_pool_url: str) -> None:
    from datetime import date

    from rde.common.expert_check import load_check_set, load_check_yaml

    data = load_check_yaml()
    assert data["version"] == "6"
    queries = data["queries"]
    assert len(queries) >= 38
    # at least 12 queries about what a person does or carries, each relevant by crop
    facets = [q for q in queries if q.get("relevant_crops")]
    assert len(facets) >= 12 and all(not q["relevant_identities"] for q in facets)
    assert {q["domain"] for q in queries} == {"pedestrian", "vehicle"}
    for q in queries:
        assert q["labelled_by"].strip(), q["id"]
        date.fromisoformat(str(q["labelled_on"]))
    check = load_check_set(demo_pool_url)  # every relevant identity has crops in the pool, none is junk
    assert check.query_ids == [q["id"] for q in queries] and len(check.queries) == len(queries)
    assert check.query_domains == [q["domain"] for q in queries]
    gallery = set(check.gallery_identities)
    assert not gallery & set(data["junk_identities"])
    for n, (qid, rel) in enumerate(zip(check.query_ids, check.relevant, strict=True)):
        assert rel <= gallery | set(check.gallery_pool_ids), qid
        assert check.relevant_positions(n), qid


def test_a_query_may_list_single_crops_as_relevant(tmp_path, demo_pool_url: str) -> None:
    """"Walking to the left" holds for some crops of a track, not all: relevant_crops lists them."""
    from rde.common.expert_check import held_out_identities, load_check_set, load_check_yaml, relevance_lists
    from storage import Artifact

    rows = [r for r in Artifact(demo_pool_url).read_shard(0, ["pool_id", "identity", "variant"]).to_pylist()
            if r["identity"] == PERSON and r["variant"] == "crop"]
    picked = [rows[0]["pool_id"], rows[-1]["pool_id"]]
    path = _write(tmp_path, [_query("q01"), _query("q02", relevant_identities=[], relevant_crops=picked)])
    check = load_check_set(demo_pool_url, path)
    assert check.relevant_positions(1) == {check.gallery_pool_ids.index(p) for p in picked}
    assert len(check.relevant_positions(0)) == len(rows) >= 2  # q01: every crop of the identity
    ranked = np.array([[check.gallery_pool_ids.index(picked[1]), 0]] * 2)
    rankings, counts = relevance_lists(check, ranked)
    assert counts == [len(rows), 2] and rankings[1][0] is True
    assert held_out_identities(load_check_yaml(path)) == {PERSON}
    bad = _write(tmp_path, [_query("q01", relevant_identities=[], relevant_crops=["vtest.avi#nobody:f0000001"])])
    with pytest.raises(ValueError, match=r"q01: vtest\.avi#nobody"):
        load_check_set(demo_pool_url, bad)

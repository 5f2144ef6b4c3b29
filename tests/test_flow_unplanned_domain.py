"""End to end: a domain nobody planned for, declared by a test as one YAML file over a detector class
no bundled domain uses (``horse``), on crops of the 1906 street film shipped with the tests
(``tests/data/horse``: one horse-drawn carriage's track, cut by the videos stage). build-secmm
builds its queries, gallery and candidates; build-largefine captions it up to the tiers; a second
declared domain the images do not show (kites) ends empty, balanced and named as such."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flows.build_largefine import build_largefine
from flows.build_secmm import build_secmm
from rde.secmm.dap_postprocess import normalise
from storage import Artifact

pytestmark = pytest.mark.slow

HORSES = Path(__file__).with_name("data") / "horse"
HORSE_DOMAIN = """\
name: dray_horse
description: Horses drawing carts and carriages.
subject:
  classes: [horse]
  noun: horse
  said_as: the horse
  nouns: [horse, horses, carriage, cart, buggy, wagon]
  mentions: [horse, carriage, cart, buggy, wagon]
  size: {min_width: 48, min_height: 48}
regions:
  - {slot: coat, fact: coat, band: [0.1, 0.6], line: horse colour, words: [coat, horse, mane]}
  - {slot: cart, fact: cart, band: [0.6, 1.0], line: cart colour, words: [cart, carriage, buggy, wagon, wheels]}
motion:
  - {name: halted, below: 0.05, says: [halted, standing]}
  - {name: trotting, at_least: 0.15, says: [trotting, trots, pulling]}
queries:
  prompt: dap_generic
  subject: horse-drawn carriages
  examples:
    - A dark horse pulling a cart across the tram tracks.
    - A horse and buggy moving to the right.
    - A black horse drawing a carriage towards the camera.
captions:
  request: Describe the horse in the image in one or two sentences.
  attributes: [the horse's coat colour, harness, the cart or carriage it draws, its colour]
  from_facts:
    dray_horse: ["A[ {coat}] horse is {motion}[ {direction}].", "The horse is {coat}."]
questions:
  coat: {q: "What colour is the horse?", a: "The horse is {value}."}
  cart: {q: "What colour is the cart it draws?", a: "The cart is {value}."}
comparisons:
  coat:
    similar_q: "What is similar about the horses?"
    similar_a: "The horse in Target-Image is {value}, like the one in Compare-Image."
    differ_q: "How do the horses differ?"
    differ_a: "The horse in Target-Image is {target}, unlike the {reference} horse in Compare-Image."
"""
KITE_DOMAIN = """\
name: kite_flyer
subject: {classes: [kite], noun: kite, said_as: the kite, nouns: [kite]}
queries: {prompt: dap_generic, subject: kites}
captions: {request: Describe the kite.}
"""


@pytest.fixture(scope="module")
def unplanned(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("unplanned")
    (root / "horse.yaml").write_text(HORSE_DOMAIN)
    (root / "kite.yaml").write_text(KITE_DOMAIN)
    images = root / "in" / "dray_horse"
    images.mkdir(parents=True)
    for path in sorted(HORSES.glob("*.jpg")):
        shutil.copy(path, images / path.name)
    overrides = {"domains": [str(root / "horse.yaml"), str(root / "kite.yaml")],
                 "input": {"kind": "folder", "path": str(root / "in")},
                 "queries": {"caption_sample_per_domain": 8, "max_rounds": 3}}
    return {"root": root, "overrides": overrides, "images": len(list(images.iterdir()))}


def test_build_secmm_builds_a_benchmark_for_a_domain_declared_in_a_file(unplanned: dict) -> None:
    summary = build_secmm(profile="demo", output_root=str(unplanned["root"] / "out"),
                          overrides=unplanned["overrides"])
    assert summary["balanced"] and summary["inputs"] == unplanned["images"] == 4
    assert summary["accepted"] == 4  # the horse is this domain's subject: one per crop, each kept
    arts = summary["artifacts"]
    queries = Artifact(arts["queries"]["url"]).to_pandas()
    assert len(queries) >= 1 and set(queries.domain) == {"dray_horse"}
    nouns = {"horse", "horses", "carriage", "cart", "buggy", "wagon"}
    assert all(nouns & set(normalise(t).split()) for t in queries.text), list(queries.text)
    gallery = Artifact(arts["gallery"]["url"]).to_pandas()
    assert len(gallery) >= 2 and set(gallery.domain) == {"dray_horse"}
    candidates = Artifact(arts["candidates"]["url"]).to_pandas()
    assert len(candidates) and set(candidates.query_id) <= set(queries.query_id)
    assert set(candidates.image_id) <= set(gallery.image_id)
    # the second domain: declared, shown by no image, said to be empty
    assert summary["domains"] == {"dray_horse": 4, "kite_flyer": 0}
    assert summary["empty_domains"] == ["kite_flyer"]
    # the captions speak of the horse in the domain file's words, from what was measured
    captions = Artifact(arts["caption_pool"]["url"]).to_pandas()
    assert captions.text.str.contains("horse").all(), list(captions.text)


def test_build_largefine_captions_the_unplanned_domain_up_to_the_tiers(unplanned: dict) -> None:
    # SmolLM2-135M sums two answers about a horse in one short sentence ("The horse is black and
    # gray."): the word floor is lowered so that the tiers' texts are kept, not what is under test
    overrides = {**unplanned["overrides"], "largefine": {"max_images": 4, "shard_size": 2, "min_words": 4}}
    summary = build_largefine(profile="demo", output_root=str(unplanned["root"] / "out-largefine"),
                              overrides=overrides, until="tiers")
    assert summary["balanced"] and summary["inputs"] == 4
    stages = {s["stage"]: s for s in summary["stages"]}
    assert "qa-tiers" in stages and "template-gallery" not in stages
    tiers = Artifact(summary["artifacts"]["tier12_captions"]["url"]).to_pandas()
    assert len(tiers) and tiers.text.str.contains("horse").any(), list(tiers.text)


def test_a_profile_whose_only_domain_has_no_images_is_an_empty_balanced_run(unplanned: dict) -> None:
    root = unplanned["root"]
    kites = root / "kites" / "kite_flyer"
    kites.mkdir(parents=True)
    for path in sorted(HORSES.glob("*.jpg"))[:2]:
        shutil.copy(path, kites / path.name)  # no kite in them: each is no_target
    summary = build_secmm(profile="demo", output_root=str(root / "out-kites"), overrides={
        "domains": [str(root / "kite.yaml")], "input": {"kind": "folder", "path": str(root / "kites")}})
    assert summary["balanced"] and summary["inputs"] == 2 and summary["accepted"] == 0
    assert summary["rejected"] == {"denoise:no_target": 2}
    assert summary["empty_domains"] == ["kite_flyer"] and summary["queries"] == 0 and summary["gallery"] == 0

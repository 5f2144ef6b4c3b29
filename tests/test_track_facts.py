"""Facts a caption or query may state beyond colours: motion and direction from a crop's video
track, carried and ridden objects from detections, and how the language uses them (pool captions,
the attribute expert's track slots, the diversity measures)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from domain_sets import DOMAINS

from models.backends.attributes import belongs_to, measure_attributes, parse_text_attributes, rides
from models.backends.detectors import Detections
from models.backends.slot_layout import slot_layout
from models.backends.track_facts import MotionOptions, motion_facts, track_fact_words, track_velocity
from rde.common import caption_stats
from rde.common.text_diversity import distinct_n, diversity, facets
from rde.common.track_slots import fuse_track_slots

LAYOUT = slot_layout(DOMAINS)
PEDESTRIAN, VEHICLE = DOMAINS["pedestrian"], DOMAINS["vehicle"]

FRAME = [768, 576]


def _track(dx: float, dy: float, height: float = 80.0, seconds: float = 2.0, fps: float = 10.0,
           domain_box_width: float = 30.0) -> dict:
    """A synthetic crop's source_meta: a box ``height`` tall whose bottom centre moves by (dx, dy)
    pixels per second, sampled at ``fps`` over ±``seconds`` around t = 2.0, in the middle of the
    frame (no side, no upper or lower part)."""
    points = []
    for k in range(int(2 * seconds * fps) + 1):
        t = k / fps
        cx, bottom = 384 + dx * (t - seconds), 300 + dy * (t - seconds)
        points.append({"time": round(t, 3), "box": [cx - domain_box_width / 2, bottom - height,
                                                     cx + domain_box_width / 2, bottom]})
    mid = points[len(points) // 2]
    return {"time": mid["time"], "box": mid["box"], "frame_size": FRAME, "track_window": points}


@pytest.mark.parametrize(("dx", "dy", "motion", "direction"), [
    (-64.0, 0.0, "walking", "left"),      # 0.8 heights/s to the left
    (64.0, 4.0, "walking", "right"),
    (0.0, 40.0, "walking", "toward"),     # down the image: toward a camera mounted above
    (3.0, -40.0, "walking", "away"),
    (0.0, 0.0, "standing", None),
    (2.0, -1.5, "standing", None),        # 0.03 heights/s: below still_speed (0.06)
    (6.0, -4.0, None, None),              # 0.09: between standing and walking, nothing said
    (-160.0, 0.0, "running", "left"),     # 2.0 heights/s
    (30.0, 28.0, "walking", None),        # diagonal: neither axis 1.5x the other
])
def test_motion_and_direction_from_a_synthetic_track(dx: float, dy: float, motion: str | None,
                                                     direction: str | None) -> None:
    facts = motion_facts(json.dumps(_track(dx, dy)), PEDESTRIAN)
    assert facts.get("motion") == ([motion] if motion else None)
    assert facts.get("direction") == ([direction] if direction else None)


def test_velocity_is_in_box_heights_per_second_by_least_squares() -> None:
    v = track_velocity(_track(-64.0, 8.0)["track_window"], 2.0, 1.0)
    assert v is not None and v.points == 21
    assert v.vx == pytest.approx(-0.8, abs=1e-9) and v.vy == pytest.approx(0.1, abs=1e-9)  # 64/80, 8/80


def test_vehicles_are_parked_or_moving_and_a_moving_camera_says_neither() -> None:
    assert motion_facts(_track(0.5, 0.0, height=60.0), VEHICLE)["motion"] == ["parked"]
    assert motion_facts(_track(-30.0, 0.0, height=60.0), VEHICLE) == {"motion": ["moving"], "direction": ["left"]}
    assert "motion" not in motion_facts(_track(3.0, 0.0, height=60.0), VEHICLE)  # 0.05: between the two
    moving_camera = {**_track(-30.0, 0.0, height=60.0), "camera": "moving"}
    assert "motion" not in motion_facts(moving_camera, VEHICLE) and "direction" not in motion_facts(moving_camera,
                                                                                                     "vehicle")


def test_distance_and_place_in_the_frame_and_no_track_no_motion() -> None:
    def box(x: float, bottom: float, height: float) -> dict:
        return {"box": [x - 5, bottom - height, x + 5, bottom], "frame_size": FRAME}

    # 50/576 = 0.087 <= 0.1: far; 220/576 = 0.38 >= 0.35: near; centre 384/768: neither side;
    # feet at 300/576 = 0.52: neither the upper nor the lower 35 %
    assert motion_facts(box(384, 300, 50), PEDESTRIAN) == {"distance": ["far"]}
    assert motion_facts(box(384, 300, 220), PEDESTRIAN) == {"distance": ["near"]}
    assert motion_facts(box(384, 300, 100), PEDESTRIAN) == {}
    # centre 200/768 = 0.26 <= 0.3: left; feet 180/576 = 0.31 <= 0.35: upper part
    assert motion_facts(box(200, 180, 100), PEDESTRIAN) == {"side": ["left"], "height": ["upper"]}
    assert motion_facts(box(600, 500, 100), PEDESTRIAN) == {"side": ["right"], "height": ["lower"]}
    moving = {**box(200, 180, 50), "camera": "moving"}  # the frame is no place in the scene any more
    assert motion_facts(moving, VEHICLE) == {"distance": ["far"]}
    assert motion_facts(None, PEDESTRIAN) == {} and motion_facts("not json", PEDESTRIAN) == {}
    few = _track(-64.0, 0.0)
    few["track_window"] = few["track_window"][9:12]  # 3 points < min_points (4)
    assert "motion" not in motion_facts(few, PEDESTRIAN, MotionOptions())


def test_words_a_track_fact_allows() -> None:
    words = track_fact_words({"motion": ["walking"], "direction": ["toward"]}, PEDESTRIAN)
    assert {"walking", "walks", "toward", "camera", "heading"} <= words and "left" not in words


# --- objects from detections ---------------------------------------------------------------------

def test_a_bag_belongs_to_the_person_who_holds_most_of_it() -> None:
    me, neighbour = np.array([100, 50, 160, 250.0]), np.array([150, 50, 210, 250.0])
    bag = np.array([152, 140, 172, 180.0])  # 8 px inside me, 20 px inside the neighbour
    assert belongs_to(bag, me, [me, neighbour]) is False and belongs_to(bag, neighbour, [me, neighbour]) is True
    mine = np.array([120, 140, 150, 180.0])
    assert belongs_to(mine, me, [me, neighbour]) is True
    far_bag = np.array([400, 140, 420, 180.0])
    assert belongs_to(far_bag, me, [me]) is False


def test_measured_carried_objects_leave_out_a_neighbours_bag() -> None:
    rgb = np.full((300, 300, 3), 128, np.uint8)
    dets = Detections(np.array([[100, 50, 160, 250], [150, 50, 210, 250], [152, 140, 172, 180],
                                [110, 100, 150, 160]], np.float32),
                      ["person", "person", "handbag", "backpack"], np.array([0.9, 0.6, 0.8, 0.7], np.float32))
    attrs = measure_attributes(rgb, dets, LAYOUT, mask_iterations=0)
    assert attrs.top("objects") == ["backpack"]  # the handbag is the neighbour's


def test_riding_needs_the_bike_under_the_person() -> None:
    rider = np.array([100, 20, 150, 160.0])
    bike = np.array([90, 100, 160, 175.0])  # the lower half overlaps, the wheels end below the feet
    assert rides(rider, bike, [rider])
    walker_beside = np.array([170, 40, 210, 200.0])
    assert not rides(walker_beside, bike, [walker_beside])
    standing_behind = np.array([100, 60, 150, 230.0])  # feet 55 px below the wheels: on the ground
    assert not rides(standing_behind, bike, [standing_behind])


def test_texts_state_motion_direction_and_riding() -> None:
    attrs = parse_text_attributes("A person in a red top walking toward the camera while riding a bicycle.", LAYOUT)
    assert attrs.top("motion") == ["walking"] and attrs.top("direction") == ["toward"]
    assert attrs.top("riding") == ["bicycle"] and attrs.top("vehicle_type") == []
    assert parse_text_attributes("A white truck that is parked.", LAYOUT).top("motion") == ["parked"]
    place = parse_text_attributes("A person on the left side of the frame heading to the right.", LAYOUT)
    assert place.top("direction") == ["right"]  # "on the left side" is a place, not a direction


# --- the attribute expert's track slots ----------------------------------------------------------

def test_track_slots_fuse_as_hand_computed() -> None:
    q = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
    g = np.array([[1.0, 0.0], [0.6, 0.8]], np.float32)
    qf, gf = fuse_track_slots(q, g, ["a person in red", "a person walking to the left"],
                              [{"motion": ["walking"], "direction": ["left"]}, {}], LAYOUT)
    scores = qf @ gf.T
    # no motion stated: the expert's own scores; stated: (1 + 1 + 1) / sqrt(3) and 0.6 / sqrt(3)
    assert scores[0] == pytest.approx([1.0, 0.6], abs=1e-6)
    assert scores[1] == pytest.approx([3 / np.sqrt(3), 0.6 / np.sqrt(3)], abs=1e-6)


# --- diversity --------------------------------------------------------------------------------------

def test_diversity_measures_by_hand() -> None:
    texts = ["A person walking to the left.", "A person walking to the right.", "A red car."]
    # bigrams: 5 + 5 + 2 = 12; repeated: "a person", "person walking", "walking to", "to the" -> 8 distinct
    assert distinct_n(texts, 2) == pytest.approx(8 / 12)
    # unigrams: 6 + 6 + 3 = 15; distinct: a person walking to the left right red car -> 9
    assert distinct_n(texts, 1) == pytest.approx(9 / 15)
    assert facets("A person in a black top walking away from the camera carrying a backpack.", LAYOUT) == \
        {"appearance", "action", "carried"}
    assert facets("A gray car far from the camera.", LAYOUT) == {"appearance", "context"}
    summary = diversity(texts, LAYOUT)
    assert summary["texts"] == 3 and summary["distinct_texts"] == 3 and summary["median_words"] == 6.0
    assert summary["facet_action"] == pytest.approx(2 / 3, abs=1e-4) and summary["two_or_more_facets"] == 0.0
    assert summary["vocabulary"] == 9 and summary["facets_used"] == 2


# --- the caption pool's language ---------------------------------------------------------------------

def test_actions_and_frames_are_read_from_pool_captions() -> None:
    nlp = caption_stats.load_tagger()
    assert caption_stats.action_phrases(nlp("A person wearing a black top is walking to the left carrying a bag.")) \
        == ["walking to the left"]
    assert caption_stats.action_phrases(nlp("The vehicle is near the camera.")) == ["near the camera"]
    assert caption_stats.action_phrases(nlp("A person dressed in dark clothing is standing.")) == ["standing"]
    uses = caption_stats.noun_uses(["A person in a black top is heading to the left.",
                                    "A person wearing a black top is walking toward the camera."])
    assert uses["top"].frames == {"in": 1, "wearing": 1}
    assert uses["top"].actions == {("black", "heading to the left"): 1, ("black", "walking toward the camera"): 1}
    assert "camera" not in {n for n, u in uses.items() if u.frames}  # nobody wears or carries the camera


def test_the_tiers_ask_and_compare_the_new_facts() -> None:
    """Q&A answered from the facts: motion with its direction in one answer, the place in the frame
    in one, each only where measured; a comparison names the measured movement of both."""
    from models.backends.measured_facts import ImageFacts, facts_qa_pairs
    from models.prompt_files import load_prompt

    prompt = load_prompt("grounded_captioner")
    target = ImageFacts([], set(), {"top": ["black"]}, PEDESTRIAN).with_track(
        {"motion": ["walking"], "direction": ["left"], "side": ["left"], "height": ["upper"]})
    answers = [a for _, a in facts_qa_pairs([target], prompt)]
    assert answers == ["The person's top is black.", "The person is walking to the left.",
                       "The person is on the left side and in the upper part of the frame."]
    standing = ImageFacts([], set(), {"top": ["red"]}, PEDESTRIAN).with_track({"motion": ["standing"],
                                                                                "height": ["lower"]})
    assert [a for _, a in facts_qa_pairs([standing], prompt)][1:] == [
        "The person is standing.", "The person is in the lower part of the frame."]
    compared = dict(facts_qa_pairs([target, standing], prompt))
    assert compared["How does what they do differ?"] == ("The person in Target-Image is walking to the left, "
                                                         "unlike the person in Compare-Image, who is standing.")
    parked = ImageFacts([], set(), {"vehicle_type": ["truck"]}, VEHICLE).with_track({"motion": ["parked"]})
    assert ("What is the vehicle doing?", "The vehicle is parked.") in facts_qa_pairs([parked], prompt)

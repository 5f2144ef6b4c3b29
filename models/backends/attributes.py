"""Visual attributes measured in an image, and the same attributes read from a text.

Both sides map into one slot vector (domain, upper-body colour, lower-body colour, carried
objects, vehicle type, vehicle colour), which is what the attribute expert compares and what the
grounded captioner is allowed to say.

Colour naming: each pixel goes to the basic colour term (Berlin–Kay, 11 terms) of its nearest
prototype in CIELAB; a region's colour is the distribution of its pixels over the terms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import cv2
import numpy as np

from models.backends.detectors import Detections

COLOURS = ["black", "white", "gray", "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown"]
# Several prototypes per term: surveillance colours are dark and washed out (denim is a dark
# greyish blue, a red jacket in shade is maroon), one saturated prototype per term misnames them.
_PROTOTYPES: list[tuple[str, tuple[int, int, int]]] = [
    ("black", (20, 20, 20)), ("black", (45, 45, 50)),
    ("white", (240, 240, 240)), ("white", (200, 205, 210)),
    ("gray", (128, 128, 128)), ("gray", (90, 92, 95)), ("gray", (165, 165, 165)),
    ("red", (190, 30, 35)), ("red", (120, 25, 30)), ("red", (150, 60, 65)),
    ("orange", (235, 130, 30)), ("orange", (190, 110, 60)),
    ("yellow", (225, 215, 50)), ("yellow", (200, 190, 110)),
    ("green", (45, 140, 60)), ("green", (50, 80, 50)), ("green", (110, 150, 100)),
    ("blue", (40, 75, 175)), ("blue", (35, 45, 85)), ("blue", (70, 90, 125)), ("blue", (140, 175, 210)),
    ("purple", (115, 50, 140)), ("purple", (75, 45, 85)),
    ("pink", (235, 150, 185)), ("pink", (200, 130, 150)),
    ("brown", (115, 75, 40)), ("brown", (75, 55, 40)), ("brown", (170, 140, 105)),
]
_PROTO_INDEX = np.array([COLOURS.index(name) for name, _ in _PROTOTYPES])
_COLOUR_LAB = cv2.cvtColor(np.array([[rgb for _, rgb in _PROTOTYPES]], np.uint8), cv2.COLOR_RGB2LAB)[0].astype(
    np.float32)

OBJECTS = ["backpack", "handbag", "umbrella", "suitcase"]
RIDDEN = ["bicycle", "motorcycle"]
VEHICLE_TYPES = ["car", "bus", "truck", "motorcycle"]
DOMAINS = ["pedestrian", "vehicle"]

COLOUR_SYNONYMS = {
    "grey": "gray", "silver": "gray", "navy": "blue", "maroon": "red", "crimson": "red", "beige": "brown",
    "tan": "brown", "khaki": "brown", "violet": "purple", "dark": "black", "light": None, "bright": None,
    **{c: c for c in COLOURS},
}
UPPER = {"shirt", "t-shirt", "tshirt", "top", "jacket", "coat", "sweater", "hoodie", "blouse", "vest", "jersey",
         "sweatshirt", "cardigan", "blazer", "parka", "upper", "torso"}
LOWER = {"pants", "trousers", "jeans", "shorts", "skirt", "leggings", "slacks", "lower", "bottoms"}
WHOLE = {"dress", "suit", "outfit", "clothes", "clothing", "uniform", "overalls"}
OBJECT_WORDS = {"backpack": "backpack", "rucksack": "backpack", "handbag": "handbag", "bag": "handbag",
                "purse": "handbag", "umbrella": "umbrella", "suitcase": "suitcase", "luggage": "suitcase"}
VEHICLE_WORDS = {"car": "car", "sedan": "car", "suv": "car", "taxi": "car", "bus": "bus", "truck": "truck",
                 "van": "truck", "lorry": "truck", "pickup": "truck", "motorcycle": "motorcycle",
                 "motorbike": "motorcycle", "scooter": "motorcycle", "vehicle": None}
PERSON_WORDS = {"man", "woman", "person", "people", "pedestrian", "boy", "girl", "child", "kid", "lady", "guy",
                "he", "she", "someone", "walker", "adult", "men", "women"}

SLOTS = {"domain": DOMAINS, "upper": COLOURS, "lower": COLOURS, "objects": OBJECTS, "riding": RIDDEN,
         "vehicle_type": VEHICLE_TYPES, "vehicle_colour": COLOURS}
SLOT_WEIGHTS = {"domain": 0.5, "upper": 1.0, "lower": 1.0, "objects": 1.0, "riding": 1.0, "vehicle_type": 1.0,
                "vehicle_colour": 1.0}
# what a text can state that only a video track measures (track_facts): parsed for the near-
# duplicate rule and the diversity facets, not part of the image-side vector
MOTIONS = ["standing", "walking", "running", "parked", "moving"]
DIRECTIONS = ["left", "right", "toward", "away"]
TEXT_SLOTS = {**SLOTS, "motion": MOTIONS, "direction": DIRECTIONS}
MOTION_TEXT = {"stand": "standing", "stands": "standing", "standing": "standing", "walk": "walking",
               "walks": "walking", "walking": "walking", "run": "running", "runs": "running", "running": "running",
               "parked": "parked", "stationary": "parked", "move": "moving", "moves": "moving", "moving": "moving",
               "drive": "moving", "drives": "moving", "driving": "moving"}
RIDDEN_WORDS = {"bicycle": "bicycle", "bike": "bicycle", "cycling": "bicycle", "cyclist": "bicycle",
                "motorcycle": "motorcycle", "motorbike": "motorcycle", "scooter": "motorcycle"}


@dataclass
class Attributes:
    """Per-slot distributions (values in [0, 1]); an empty slot means 'not measured / not said'."""

    slots: dict[str, np.ndarray] = field(default_factory=dict)
    lightness: float | None = None  # median CIELAB L* (0–100) of the person's clothing pixels

    def vector(self) -> np.ndarray:
        """Weighted concatenation of all slots (zeros where empty), L2-normalised."""
        parts = []
        for name, vocab in SLOTS.items():
            v = self.slots.get(name)
            v = np.zeros(len(vocab), np.float32) if v is None else np.asarray(v, np.float32)
            norm = np.linalg.norm(v)
            parts.append(SLOT_WEIGHTS[name] * (v / norm if norm > 0 else v))
        vec = np.concatenate(parts)
        norm = np.linalg.norm(vec)
        return vec / norm if norm > 0 else vec

    def top(self, slot: str, min_share: float = 0.0) -> list[str]:
        """Names in a slot ordered by weight, keeping those at or above ``min_share``."""
        v = self.slots.get(slot)
        if v is None:
            return []
        vocab = TEXT_SLOTS[slot]
        order = np.argsort(-v)
        return [vocab[i] for i in order if v[i] > 0 and v[i] >= min_share]


def colour_distribution(rgb: np.ndarray) -> np.ndarray | None:
    """Share of the region's pixels nearest to each basic colour term (None for an empty region)."""
    if rgb.size == 0:
        return None
    lab = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2LAB).reshape(-1, 3).astype(np.float32)
    # L is scaled to 0..255 by OpenCV; halve its weight so lighting changes matter less than hue
    diff = lab[:, None, :] - _COLOUR_LAB[None, :, :]
    diff[:, :, 0] *= 0.5
    nearest = _PROTO_INDEX[np.argmin((diff**2).sum(axis=2), axis=1)]
    return np.bincount(nearest, minlength=len(COLOURS)).astype(np.float32) / len(nearest)


def _region(rgb: np.ndarray, box: np.ndarray, top: float, bottom: float, side: float = 0.2) -> np.ndarray:
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    r0, r1 = int(y1 + top * h), int(y1 + bottom * h)
    c0, c1 = int(x1 + side * w), int(x2 - side * w)
    return rgb[max(r0, 0) : max(r1, 0), max(c0, 0) : max(c1, 0)]


def person_mask(rgb: np.ndarray, box: np.ndarray, iterations: int = 2,
                min_background: float = 0.05) -> np.ndarray | None:
    """The person's pixels inside ``box`` by GrabCut (Rother et al., 2004) initialised with the box
    (outside = background). The box halves also hold pavement and grass, which colour naming read as
    white or green trousers. None when less than ``min_background`` of the image lies outside the
    box: GrabCut then has no background to learn from."""
    h, w = rgb.shape[:2]
    x1, y1 = max(int(box[0]), 1), max(int(box[1]), 1)
    x2, y2 = min(int(np.ceil(box[2])), w - 1), min(int(np.ceil(box[3])), h - 1)
    if x2 - x1 < 4 or y2 - y1 < 4 or 1.0 - (x2 - x1) * (y2 - y1) / float(h * w) < min_background:
        return None
    mask = np.zeros((h, w), np.uint8)
    models = (np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64))
    cv2.setRNGSeed(0)  # GrabCut seeds its colour models by k-means on this thread's RNG: same image, same mask
    cv2.grabCut(cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR), mask, (x1, y1, x2 - x1, y2 - y1),
                *models, iterations, cv2.GC_INIT_WITH_RECT)
    return (mask == cv2.GC_FGD) | (mask == cv2.GC_PR_FGD)


def masked_colours(rgb: np.ndarray, box: np.ndarray, top: float, bottom: float, mask: np.ndarray | None,
                   min_share: float = 0.05) -> np.ndarray | None:
    """Colour distribution of the rows ``top``..``bottom`` of ``box``: over the person's pixels when
    ``mask`` holds at least ``min_share`` of the band (thin legs in a loose box hold 10–15 %), else
    (no mask, or GrabCut lost the person) over the band's central 60 % of columns."""
    if mask is not None:
        x1, y1, x2, y2 = box
        bh = y2 - y1
        r0, r1 = max(int(y1 + top * bh), 0), max(int(y1 + bottom * bh), 0)
        c0, c1 = max(int(x1), 0), max(int(np.ceil(x2)), 0)
        band, keep = rgb[r0:r1, c0:c1], mask[r0:r1, c0:c1]
        if keep.size and keep.mean() >= min_share:
            return colour_distribution(band[keep][None])
    return colour_distribution(_region(rgb, box, top, bottom))


def clothing_lightness(rgb: np.ndarray, box: np.ndarray, mask: np.ndarray | None) -> float | None:
    """Median CIELAB lightness L* (0–100) of rows 15–85 % of the person's box, over the person's
    pixels when the mask holds at least 5 % of them (``masked_colours``' rule), else over the
    central 60 % of columns."""
    x1, y1, x2, y2 = box
    r0, r1 = max(int(y1 + 0.15 * (y2 - y1)), 0), max(int(y1 + 0.85 * (y2 - y1)), 0)
    c0, c1 = max(int(x1), 0), max(int(np.ceil(x2)), 0)
    band = rgb[r0:r1, c0:c1]
    keep = mask[r0:r1, c0:c1] if mask is not None else None
    pixels = band[keep] if keep is not None and keep.size and keep.mean() >= 0.05 else \
        _region(rgb, box, 0.15, 0.85).reshape(-1, 3)
    if not len(pixels):
        return None
    lab = cv2.cvtColor(np.ascontiguousarray(pixels.reshape(1, -1, 3)), cv2.COLOR_RGB2LAB)
    return float(np.median(lab[..., 0])) * 100.0 / 255.0


def _largest(dets: Detections, classes: set[str]) -> tuple[np.ndarray, str, float] | None:
    mine = dets.of_classes(classes)
    if not len(mine):
        return None
    areas = (mine.boxes[:, 2] - mine.boxes[:, 0]) * (mine.boxes[:, 3] - mine.boxes[:, 1])
    i = int(np.argmax(areas * mine.scores))
    return mine.boxes[i], mine.labels[i], float(mine.scores[i])


def measure_attributes(rgb: np.ndarray, dets: Detections, object_min_score: float = 0.3,
                       mask_iterations: int = 2) -> Attributes:
    """Attributes of the main subject (largest confident person or vehicle; whole image if none).

    Person: upper body = rows 15–50 % of the box, lower body = 50–85 %, over the person's pixels
    (``person_mask``, GrabCut with ``mask_iterations``; 0 = no mask, the central 60 % of columns).
    Carried objects: detections of bag classes that belong to the person (``belongs_to``: mostly
    inside the box, not held more by another detected person); a ridden bicycle or motorcycle
    (``rides``); clothing lightness (``clothing_lightness``). None of these without a detected person.
    Vehicle: type from the detector label, colour from the central 60 % of its box.
    """
    h, w = rgb.shape[:2]
    whole = np.array([0, 0, w, h], np.float32)
    person = _largest(dets, {"person"})
    vehicle = _largest(dets, set(VEHICLE_TYPES))
    attrs = Attributes()
    person_area = 0.0 if person is None else float(np.prod(person[0][2:] - person[0][:2]))
    vehicle_area = 0.0 if vehicle is None else float(np.prod(vehicle[0][2:] - vehicle[0][:2]))
    if vehicle is not None and vehicle_area > person_area:
        box, label, _ = vehicle
        attrs.slots["domain"] = np.array([0.0, 1.0], np.float32)
        attrs.slots["vehicle_type"] = np.array([float(t == label) for t in VEHICLE_TYPES], np.float32)
        attrs.slots["vehicle_colour"] = colour_distribution(_region(rgb, box, 0.2, 0.8))
        return attrs
    box = person[0] if person is not None else whole
    attrs.slots["domain"] = np.array([1.0, 0.0], np.float32)
    mask = person_mask(rgb, box, mask_iterations) if person is not None and mask_iterations > 0 else None
    attrs.slots["upper"] = masked_colours(rgb, box, 0.15, 0.5, mask)
    attrs.slots["lower"] = masked_colours(rgb, box, 0.5, 0.85, mask)
    attrs.lightness = clothing_lightness(rgb, box, mask) if person is not None else None
    people = [b for b, lab, sc in zip(dets.boxes, dets.labels, dets.scores, strict=True)
              if lab == "person" and sc >= object_min_score]
    carried = np.zeros(len(OBJECTS), np.float32)
    riding = np.zeros(len(RIDDEN), np.float32)
    for obj_box, label, score in zip(dets.boxes, dets.labels, dets.scores, strict=True):
        if score < object_min_score or person is None:
            continue
        if label in OBJECTS and belongs_to(obj_box, box, people):
            carried[OBJECTS.index(label)] = max(carried[OBJECTS.index(label)], float(score))
        elif label in RIDDEN and rides(box, obj_box, people):
            riding[RIDDEN.index(label)] = max(riding[RIDDEN.index(label)], float(score))
    attrs.slots["objects"] = carried
    attrs.slots["riding"] = riding
    return attrs


def _intersection(a: np.ndarray, b: np.ndarray) -> float:
    return float(max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1])))


def _area(a: np.ndarray) -> float:
    return float(max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1]))


def belongs_to(obj: np.ndarray, person: np.ndarray, people: list[np.ndarray], min_share: float = 0.3) -> bool:
    """Whether a carried object's box is the subject's: at least ``min_share`` of the object lies
    inside the subject's box, and no other detected person holds more of it (ties go to the
    person whose box centre is nearer the object's). A bag between two people belongs to the one
    it overlaps most: overlap alone gave the subject a neighbour's handbag."""
    share = _intersection(obj, person) / max(_area(obj), 1e-6)
    if share < min_share:
        return False
    centre = np.array([(obj[0] + obj[2]) / 2, (obj[1] + obj[3]) / 2])

    def distance(box: np.ndarray) -> float:
        return float(np.hypot(*(centre - [(box[0] + box[2]) / 2, (box[1] + box[3]) / 2])))

    for other in people:
        if np.allclose(other, person):
            continue
        other_share = _intersection(obj, other) / max(_area(obj), 1e-6)
        if other_share > share or (other_share == share and distance(other) < distance(person)):
            return False
    return True


def rides(person: np.ndarray, ridden: np.ndarray, people: list[np.ndarray], min_share: float = 0.3) -> bool:
    """Whether the subject rides a bicycle or motorcycle: the vehicle's box overlaps the lower half
    of the person's box by at least ``min_share`` of that half, the person's feet are no lower than
    the wheels' bottom edge plus a tenth of the person's height (a rider's feet are on the pedals;
    a person standing in front of a parked bicycle, nearer the camera, has feet well below its
    wheels), and no other detected person holds more of it (``belongs_to``'s rule)."""
    h = person[3] - person[1]
    lower = np.array([person[0], person[1] + h / 2, person[2], person[3]])
    if _intersection(ridden, lower) / max(_area(lower), 1e-6) < min_share:
        return False
    if person[3] > ridden[3] + 0.1 * h:
        return False
    return belongs_to(ridden, person, people, min_share=0.0)


_TOKEN = re.compile(r"[a-z]+(?:-[a-z]+)?")


def parse_text_attributes(text: str, window: int = 3) -> Attributes:
    """Attributes a text states: colour words bound to the nearest garment (ahead first, then
    behind, within ``window`` tokens), carried objects, vehicle type and colour, domain."""
    tokens = _TOKEN.findall(text.lower())
    attrs = Attributes()
    is_vehicle = any(t in VEHICLE_WORDS for t in tokens)
    is_person = any(t in PERSON_WORDS for t in tokens) or any(t in UPPER | LOWER | WHOLE for t in tokens)
    if is_vehicle and not is_person:
        attrs.slots["domain"] = np.array([0.0, 1.0], np.float32)
    elif is_person:
        attrs.slots["domain"] = np.array([1.0, 0.0], np.float32)
    upper = np.zeros(len(COLOURS), np.float32)
    lower = np.zeros(len(COLOURS), np.float32)
    vcol = np.zeros(len(COLOURS), np.float32)
    for i, tok in enumerate(tokens):
        colour = COLOUR_SYNONYMS.get(tok)
        if colour is None:
            continue
        if tok == "dark" and i + 1 < len(tokens) and COLOUR_SYNONYMS.get(tokens[i + 1]):
            continue  # "dark blue" → blue
        c = COLOURS.index(colour)
        if is_vehicle and not is_person:
            vcol[c] = 1.0
            continue
        target = _garment_near(tokens, i, window)
        if target == "upper":
            upper[c] = 1.0
        elif target == "lower":
            lower[c] = 1.0
        else:  # "in black", "a red dress": the whole outfit
            upper[c] = max(upper[c], 0.5)
            lower[c] = max(lower[c], 0.5)
    if upper.any():
        attrs.slots["upper"] = upper
    if lower.any():
        attrs.slots["lower"] = lower
    if vcol.any():
        attrs.slots["vehicle_colour"] = vcol
    objects = np.zeros(len(OBJECTS), np.float32)
    for tok in tokens:
        if tok in OBJECT_WORDS:
            objects[OBJECTS.index(OBJECT_WORDS[tok])] = 1.0
    if objects.any():
        attrs.slots["objects"] = objects
    vtype = np.zeros(len(VEHICLE_TYPES), np.float32)
    riding = np.zeros(len(RIDDEN), np.float32)
    for tok in tokens:
        if is_person and RIDDEN_WORDS.get(tok):  # "a person riding a motorcycle": ridden, not the subject
            riding[RIDDEN.index(RIDDEN_WORDS[tok])] = 1.0
        elif VEHICLE_WORDS.get(tok):
            vtype[VEHICLE_TYPES.index(VEHICLE_WORDS[tok])] = 1.0
    if vtype.any():
        attrs.slots["vehicle_type"] = vtype
    if riding.any():
        attrs.slots["riding"] = riding
    _parse_track_words(tokens, attrs)
    return attrs


_HEADING_WORDS = {"heading", "heads", "head", "walking", "walks", "walk", "moving", "moves", "going", "goes",
                  "running", "runs", "turning", "turns"}


def _parse_track_words(tokens: list[str], attrs: Attributes) -> None:
    """The motion ("walking", "parked") and direction ("to the left", "toward the camera", "away
    from it") a text states, into the ``motion`` and ``direction`` slots."""
    motion = np.zeros(len(MOTIONS), np.float32)
    direction = np.zeros(len(DIRECTIONS), np.float32)
    for i, tok in enumerate(tokens):
        if tok in MOTION_TEXT:
            motion[MOTIONS.index(MOTION_TEXT[tok])] = 1.0
        before = tokens[max(i - 2, 0):i]
        if tok in {"left", "right"} and ({"to", "toward", "towards"} & set(before)
                                         or (before and before[-1] in _HEADING_WORDS)):
            direction[DIRECTIONS.index(tok)] = 1.0  # "to the left", "heading left"; not "on the left side"
        elif tok in {"leftward", "leftwards", "rightward", "rightwards"}:
            direction[DIRECTIONS.index(tok[:4] if tok.startswith("left") else "right")] = 1.0
        elif tok in {"toward", "towards"} and tokens[i + 1 : i + 3] in (["the", "camera"], ["camera"]):
            direction[DIRECTIONS.index("toward")] = 1.0
        elif tok == "away":
            direction[DIRECTIONS.index("away")] = 1.0
    if motion.any():
        attrs.slots["motion"] = motion
    if direction.any():
        attrs.slots["direction"] = direction


_CONNECTORS = {"and", "or", "with", "light", "bright", "pale", "deep"}


def _garment_near(tokens: list[str], i: int, window: int) -> str | None:
    """The garment a colour word at ``i`` describes: look ahead, then behind, counting only
    words that are neither colours nor connectors ("red and navy blue jacket" → jacket)."""
    def scan(indices: range) -> str | None:
        seen = 0
        for j in indices:
            tok = tokens[j]
            if tok in UPPER:
                return "upper"
            if tok in LOWER:
                return "lower"
            if tok in WHOLE:
                return "whole"
            if tok in COLOUR_SYNONYMS or tok in _CONNECTORS:
                continue
            seen += 1
            if seen >= window:
                return None
        return None

    return scan(range(i + 1, len(tokens))) or scan(range(i - 1, -1, -1))

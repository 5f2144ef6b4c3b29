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
from models.backends.slot_layout import COLOURS, DIRECTIONS, SlotLayout
from models.domains import Domain, Region

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

COLOUR_SYNONYMS = {
    "grey": "gray", "silver": "gray", "navy": "blue", "maroon": "red", "crimson": "red", "beige": "brown",
    "tan": "brown", "khaki": "brown", "violet": "purple", "dark": "black", "light": None, "bright": None,
    **{c: c for c in COLOURS},
}
DOMAIN_WEIGHT = 0.5  # the domain slot's weight in the vector; every other slot weighs 1


@dataclass
class Attributes:
    """Per-slot distributions (values in [0, 1]) over ``layout``'s vocabularies; an empty slot means
    'not measured / not said'."""

    layout: SlotLayout
    slots: dict[str, np.ndarray] = field(default_factory=dict)
    lightness: float | None = None  # median CIELAB L* (0–100) of the subject's pixels (a domain with tone)

    def vector(self) -> np.ndarray:
        """Weighted concatenation of all slots (zeros where empty), L2-normalised."""
        parts = []
        for name, vocab in self.layout.slots.items():
            v = self.slots.get(name)
            v = np.zeros(len(vocab), np.float32) if v is None else np.asarray(v, np.float32)
            norm = np.linalg.norm(v)
            parts.append((DOMAIN_WEIGHT if name == "domain" else 1.0) * (v / norm if norm > 0 else v))
        vec = np.concatenate(parts)
        norm = np.linalg.norm(vec)
        return vec / norm if norm > 0 else vec

    def top(self, slot: str, min_share: float = 0.0) -> list[str]:
        """Names in a slot ordered by weight, keeping those at or above ``min_share``."""
        v = self.slots.get(slot)
        if v is None:
            return []
        vocab = self.layout.text_slots[slot]
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
                   min_share: float = 0.05, side: float = 0.2) -> np.ndarray | None:
    """Colour distribution of the rows ``top``..``bottom`` of ``box``: over the person's pixels when
    ``mask`` holds at least ``min_share`` of the band (thin legs in a loose box hold 10–15 %), else
    (no mask, or GrabCut lost the person) over the band's columns less ``side`` of the width on
    each side (the central 60 % by default)."""
    if mask is not None:
        x1, y1, x2, y2 = box
        bh = y2 - y1
        r0, r1 = max(int(y1 + top * bh), 0), max(int(y1 + bottom * bh), 0)
        c0, c1 = max(int(x1), 0), max(int(np.ceil(x2)), 0)
        band, keep = rgb[r0:r1, c0:c1], mask[r0:r1, c0:c1]
        if keep.size and keep.mean() >= min_share:
            return colour_distribution(band[keep][None])
    return colour_distribution(_region(rgb, box, top, bottom, side))


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


def measure_attributes(rgb: np.ndarray, dets: Detections, layout: SlotLayout, object_min_score: float = 0.3,
                       mask_iterations: int = 2) -> Attributes:
    """Attributes of the main subject: of each domain the largest confident detection of its
    classes (``_largest``), and of those the largest box (ties and no detection: the first domain,
    measured over the whole image).

    Per region, the colour distribution of its band of rows: over the subject's pixels for a domain
    with ``appearance.mask`` (``person_mask``, GrabCut with ``mask_iterations``; 0 = no mask), else
    over the band's central columns. The type (a domain with ``subject.types``) is the detector's
    class. Carried objects: detections of the domain's carried classes that belong to the subject
    (``belongs_to``: mostly inside its box, not held more by another subject of the domain); ridden
    ones by ``rides``; the clothing lightness (``clothing_lightness``) for a domain with
    ``appearance.tone``. None of these without a detected subject."""
    h, w = rgb.shape[:2]
    domains = list(layout.domains)
    found = {d.name: _largest(dets, set(d.subject.classes)) for d in domains}

    def area(d: Domain) -> float:
        hit = found[d.name]
        return 0.0 if hit is None else float(np.prod(hit[0][2:] - hit[0][:2]))

    subject = domains[0]
    for d in domains[1:]:
        if found[d.name] is not None and area(d) > area(subject):
            subject = d
    hit = found[subject.name]
    box = hit[0] if hit is not None else np.array([0, 0, w, h], np.float32)
    attrs = Attributes(layout)
    attrs.slots["domain"] = layout.onehot("domain", subject.name)
    if subject.subject.types is not None and hit is not None:
        attrs.slots[subject.subject.types.slot] = layout.onehot(subject.subject.types.slot, hit[1])
    use_mask = subject.appearance.mask and hit is not None and mask_iterations > 0
    mask = person_mask(rgb, box, mask_iterations) if use_mask else None
    for region in subject.regions:
        attrs.slots[region.slot] = masked_colours(rgb, box, region.band[0], region.band[1], mask, side=region.side)
    if subject.appearance.tone and hit is not None:
        attrs.lightness = clothing_lightness(rgb, box, mask)
    subjects = [b for b, lab, sc in zip(dets.boxes, dets.labels, dets.scores, strict=True)
                if lab in subject.subject.classes and sc >= object_min_score]
    for spec in (subject.carried, subject.ridden):
        if spec is None:
            continue
        classes = [item.label for item in spec.items]
        scores = np.zeros(len(classes), np.float32)
        for obj_box, label, score in zip(dets.boxes, dets.labels, dets.scores, strict=True):
            if hit is None or score < object_min_score or label not in classes:
                continue
            if rides(box, obj_box, subjects) if spec.relation == "under" else belongs_to(obj_box, box, subjects):
                k = classes.index(label)
                scores[k] = max(scores[k], float(score))
        attrs.slots[spec.slot] = scores
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


def parse_text_attributes(text: str, layout: SlotLayout, window: int = 3) -> Attributes:
    """Attributes a text states: its domain (the first of the profile's domains it mentions),
    colour words bound to that domain's nearest region word (ahead first, then behind, within
    ``window`` tokens; a domain without region words takes every colour into its first region),
    carried objects, the ridden object of a domain that rides, types, motion and direction."""
    tokens = _TOKEN.findall(text.lower())
    attrs = Attributes(layout)
    mentioned = [d for d in layout.domains if any(t in layout.mentions[d.name] for t in tokens)]
    if mentioned:
        attrs.slots["domain"] = layout.onehot("domain", mentioned[0].name)
    subject = mentioned[0] if mentioned else next(iter(layout.domains))
    worded = [r for r in subject.regions if r.words]
    colours = {r.slot: np.zeros(len(COLOURS), np.float32) for r in subject.regions}
    for i, tok in enumerate(tokens):
        colour = COLOUR_SYNONYMS.get(tok)
        if colour is None or not colours:
            continue
        if tok == "dark" and i + 1 < len(tokens) and COLOUR_SYNONYMS.get(tokens[i + 1]):
            continue  # "dark blue" → blue
        c = COLOURS.index(colour)
        if not worded:
            colours[subject.regions[0].slot][c] = 1.0
            continue
        target = _region_near(tokens, i, window, worded, set(subject.appearance.whole_words))
        if target is not None:
            colours[target][c] = 1.0
        else:  # "in black", "a red dress": the whole outfit
            for region in worded:
                colours[region.slot][c] = max(colours[region.slot][c], 0.5)
    attrs.slots.update({slot: v for slot, v in colours.items() if v.any()})
    ridden = {w: item.label for item in subject.ridden.items for w in item.words} if subject.ridden and mentioned \
        else {}
    found: dict[str, np.ndarray] = {}

    def mark(slot: str, value: str) -> None:
        found.setdefault(slot, np.zeros(len(layout.slots[slot]), np.float32))[layout.slots[slot].index(value)] = 1.0

    for tok in tokens:
        if tok in layout.carried_words:
            mark(*layout.carried_words[tok])
        if tok in ridden:  # "a person riding a motorcycle": ridden, not the subject
            mark(subject.ridden.slot, ridden[tok])
        elif tok in layout.type_words:
            mark(*layout.type_words[tok])
    attrs.slots.update(found)
    _parse_track_words(tokens, attrs)
    return attrs


_HEADING_WORDS = {"heading", "heads", "head", "walking", "walks", "walk", "moving", "moves", "going", "goes",
                  "running", "runs", "turning", "turns"}


def _parse_track_words(tokens: list[str], attrs: Attributes) -> None:
    """The motion ("walking", "parked": the domains' states' ``says`` words) and direction ("to the
    left", "toward the camera", "away from it") a text states, into the ``motion`` and ``direction``
    slots."""
    motions = attrs.layout.text_slots["motion"]
    motion_text = attrs.layout.motion_text
    motion = np.zeros(len(motions), np.float32)
    direction = np.zeros(len(DIRECTIONS), np.float32)
    for i, tok in enumerate(tokens):
        if tok in motion_text:
            motion[motions.index(motion_text[tok])] = 1.0
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


def _region_near(tokens: list[str], i: int, window: int, regions: list[Region], whole: set[str]) -> str | None:
    """The region slot a colour word at ``i`` describes: look ahead, then behind, counting only
    words that are neither colours nor connectors ("red and navy blue jacket" → jacket); None for a
    whole-covering word ("dress") or none within ``window``."""
    def scan(indices: range) -> str | None:
        seen = 0
        for j in indices:
            tok = tokens[j]
            for region in regions:
                if tok in region.words:
                    return region.slot
            if tok in whole:
                return "whole"
            if tok in COLOUR_SYNONYMS or tok in _CONNECTORS:
                continue
            seen += 1
            if seen >= window:
                return None
        return None

    target = scan(range(i + 1, len(tokens))) or scan(range(i - 1, -1, -1))
    return None if target == "whole" else target

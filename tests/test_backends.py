"""Model backends through their real code paths: bundled weights on demo images, and the
production (transformers) backends on tiny random-weight models built from config."""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
from domain_sets import DOMAINS, LAYOUT
from tiny_models import build_tiny_clip, build_tiny_dinov2, build_tiny_qwen2vl, build_tiny_qwen3, random_images

from models.backends.attributes import (
    COLOURS,
    colour_distribution,
    measure_attributes,
    parse_text_attributes,
    person_mask,
)
from models.backends.caption_grounding import claim_words, keep_grounded, ungrounded_words
from models.backends.detectors import Detections
from models.backends.grounded_captioner import GroundedCaptionGenerator
from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, TokenLogprob
from models.backends.measured_facts import describe_image, type_agrees
from models.backends.model_errors import ModelLoadError
from models.backends.registry import ModelRegistry
from models.domains import load_domains
from models.specs import ModelSpec
from rde.profile import ProfileError, load_profile


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry.of(load_profile("demo"))


@pytest.fixture(scope="module")
def crops(pool_rows: dict[str, dict]) -> dict[str, list[np.ndarray]]:
    """Real crops grouped by identity (identities with >= 3 crops: persons, the parked van, street vehicles)."""
    from rde.common.image_decoding import decode_rgb

    groups: dict[str, list[np.ndarray]] = {}
    for row in pool_rows.values():
        if row["variant"] == "crop":
            groups.setdefault(row["identity"], []).append(decode_rgb(row["image_bytes"]))
    return {k: v for k, v in groups.items() if len(v) >= 3}


def _norms(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x, axis=1)


# --- q_txt -------------------------------------------------------------------------------------

def test_mean_token_probability_is_the_mean_not_the_product() -> None:
    res = GenerationResult("r", "ab", [TokenLogprob("a", math.log(0.5)), TokenLogprob("b", math.log(0.25))], "m")
    assert res.mean_token_probability == pytest.approx(0.375)
    assert GenerationResult("r", "", [], "m").mean_token_probability is None


VAN = "vtest.avi#vehicle-s000-0002"  # vtest.avi's parked white van
AUTOMOBILE = "street.mp4#vehicle-s000-0206"  # the street film's open-top black automobile


# --- offline backends, real weights ------------------------------------------------------------

def test_efficientnet_embedder_on_real_crops(registry: ModelRegistry, crops: dict[str, list[np.ndarray]]) -> None:
    emb = registry.image_embedder()
    assert emb.dim == 1280 and registry.image_embedder() is emb  # loaded once per process
    van = crops[VAN][:2]
    vecs = emb.embed(van)
    assert vecs.shape == (2, 1280) and np.allclose(_norms(vecs), 1, atol=1e-5)
    assert emb.feature_maps(van).shape == (2, 49, 1280)
    probs = emb.class_probabilities(van)
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-4)
    top = {emb.class_names[i] for p in probs for i in np.argsort(-p)[:5]}
    assert top & {"minivan", "moving van", "police van", "ambulance", "minibus", "car wheel", "pickup",
                  "cab", "jeep", "grille", "recreational vehicle", "tow truck", "trailer truck"}, top
    # frames of one identity are closer to each other than to other identities
    ids = sorted(crops)[:12]
    vecs = [emb.embed(crops[i][:3]) for i in ids]
    same = np.mean([float((v @ v.T)[np.triu_indices(len(v), 1)].mean()) for v in vecs])
    cross = np.mean([float((vecs[a] @ vecs[b].T).mean()) for a in range(len(ids)) for b in range(a + 1, len(ids))])
    assert same > cross + 0.05


def test_minilm_text_encoder(registry: ModelRegistry) -> None:
    enc = registry.text_encoder()
    v = enc.encode(["a man in a red jacket", "a person wearing a crimson coat", "a white van parked outside"])
    assert v.shape == (3, 384) and np.allclose(_norms(v), 1, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]
    assert enc.encode([]).shape == (0, 384)


def test_offline_experts_rank_matching_crops_first(registry: ModelRegistry,
                                                   crops: dict[str, list[np.ndarray]]) -> None:
    gallery = crops[VAN][:2] + crops[AUTOMOBILE][:2]
    for spec in load_profile("demo").models.experts:
        expert = registry.expert(spec)
        img = expert.encode_image(gallery)
        txt = expert.encode_text(["a white van", "an old black automobile"])
        assert img.shape == (4, expert.dim) and txt.shape == (2, expert.dim)
        scores = txt @ img.T
        assert scores[0, :2].mean() > scores[0, 2:].mean(), spec.backend


# --- attributes -------------------------------------------------------------------------------

def test_colour_naming_of_pure_and_surveillance_colours() -> None:
    for name, rgb in [("red", (200, 30, 30)), ("blue", (40, 60, 180)), ("black", (15, 15, 15)),
                      ("white", (245, 245, 245)), ("blue", (40, 50, 85)), ("green", (40, 140, 50))]:
        dist = colour_distribution(np.full((10, 10, 3), rgb, np.uint8))
        assert COLOURS[int(np.argmax(dist))] == name and dist.max() == 1.0, (name, rgb)
    assert colour_distribution(np.zeros((0, 3, 3), np.uint8)) is None


def test_measured_attributes_follow_the_person_box() -> None:
    image = np.full((200, 100, 3), 128, np.uint8)
    image[40:100, 20:80] = (200, 30, 30)  # upper body red
    image[100:170, 20:80] = (40, 60, 180)  # lower body blue
    dets = Detections(np.array([[20, 10, 80, 180], [60, 90, 90, 130]], np.float32), ["person", "handbag"],
                      np.array([0.9, 0.6], np.float32))
    attrs = measure_attributes(image, dets, LAYOUT)
    assert attrs.top("upper")[0] == "red" and attrs.top("lower")[0] == "blue"
    assert attrs.top("objects") == ["handbag"] and attrs.top("domain") == ["pedestrian"]
    text = parse_text_attributes("a woman in a red jacket and blue jeans carrying a bag", LAYOUT)
    other = parse_text_attributes("a man in a green shirt and black trousers", LAYOUT)
    assert attrs.vector() @ text.vector() > attrs.vector() @ other.vector()


def _person_on_pavement() -> tuple[np.ndarray, Detections]:
    """A thin person (red top, blue trousers) on light pavement, boxed loosely as a detector does:
    the box's central columns are mostly pavement beside the legs."""
    rng = np.random.default_rng(0)
    image = np.clip(rng.normal(225, 6, (200, 120, 3)), 0, 255).astype(np.uint8)  # light pavement
    image[40:95, 50:70] = (200, 30, 30)  # upper body, 20 px wide
    image[95:175, 54:58] = (40, 60, 180)  # two thin legs
    image[95:175, 62:66] = (40, 60, 180)
    return image, Detections(np.array([[30, 10, 90, 185]], np.float32), ["person"], np.array([0.9], np.float32))


def test_person_mask_keeps_pavement_out_of_the_garment_colours() -> None:
    """In the box's lower band the pavement outnumbers the legs 5:1: without the mask the
    trousers read white; GrabCut keeps the legs, and the trousers read blue."""
    image, dets = _person_on_pavement()
    boxed = measure_attributes(image, dets, LAYOUT, mask_iterations=0)
    assert boxed.top("lower")[0] == "white"  # what the box halves said (the demo's "white bottoms")
    masked = measure_attributes(image, dets, LAYOUT)
    assert masked.top("lower", 0.2) == ["blue"] and masked.top("upper", 0.2) == ["red"]
    mask = person_mask(image, dets.boxes[0])
    assert mask is not None and mask[140, 55] and not mask[140, 35]
    assert person_mask(image, np.array([0, 0, 120, 200], np.float32)) is None  # nothing outside the box


def test_person_mask_is_the_same_whatever_ran_before(pool_rows: dict[str, dict]) -> None:
    """GrabCut seeds its colour models from OpenCV's RNG; unseeded, 21 of 40 demo crops got another
    mask once anything had drawn from it (and the attribute expert's vectors changed with call order)."""
    from rde.common.image_decoding import decode_rgb

    crops = [decode_rgb(r["image_bytes"]) for r in list(pool_rows.values())[:20]]
    boxes = [np.array([c.shape[1] * 0.2, c.shape[0] * 0.05, c.shape[1] * 0.8, c.shape[0] * 0.95], np.float32)
             for c in crops]
    first = [person_mask(c, b) for c, b in zip(crops, boxes, strict=True)]
    cv2.kmeans(np.random.default_rng(1).random((50, 3), np.float32), 3, None,  # draws from OpenCV's RNG
               (cv2.TERM_CRITERIA_MAX_ITER, 5, 1.0), 2, cv2.KMEANS_RANDOM_CENTERS)
    again = [person_mask(c, b) for c, b in zip(reversed(crops), reversed(boxes), strict=True)][::-1]
    assert all(a is not None and np.array_equal(a, b) for a, b in zip(first, again, strict=True))


TYPES = DOMAINS["vehicle"].subject.types
CLAIMS = claim_words(DOMAINS)


def test_vehicle_type_stands_unless_the_classifier_contradicts_it() -> None:
    """Evidence = summed probability of a type's ImageNet classes among the top 10 (hand-computed)."""
    names = ["Model T", "garbage truck", "moped", "horse cart", "tabby", "cab"]
    probs = lambda *p: np.array(p, np.float32)  # noqa: E731
    # the demo's 1906 car typed "motorcycle": Model T .33, no moped → motorcycle is not said
    assert not type_agrees("motorcycle", probs(0.33, 0.0, 0.0, 0.0, 0.6, 0.0), names, TYPES)
    # the same image typed "car": its own evidence .33 ≥ .05 support
    assert type_agrees("car", probs(0.33, 0.0, 0.0, 0.0, 0.6, 0.0), names, TYPES)
    # a car with weak support (.06 cab) beside strong truck evidence still stands: support wins
    assert type_agrees("car", probs(0.0, 0.5, 0.0, 0.0, 0.4, 0.06), names, TYPES)
    # a horse cart typed "car": car .04 < .05, "other" .12 ≥ .1 → contradicted
    assert not type_agrees("car", probs(0.02, 0.0, 0.0, 0.12, 0.8, 0.02), names, TYPES)
    # no vehicle class above .1: nothing contradicts, the detector stands
    assert type_agrees("bus", probs(0.03, 0.04, 0.0, 0.02, 0.9, 0.01), names, TYPES)


def test_a_contradicted_vehicle_type_is_not_a_fact() -> None:
    image = np.full((100, 200, 3), 128, np.uint8)
    image[20:80, 30:170] = (20, 20, 20)
    dets = Detections(np.array([[30, 20, 170, 80]], np.float32), ["motorcycle"], np.array([0.8], np.float32))
    names = ["Model T", "moped", "tabby"]
    facts = describe_image(image, dets, np.array([0.4, 0.0, 0.6], np.float32), names, LAYOUT)
    assert facts.values["vehicle_type"] == [] and "subject: a vehicle" in facts.lines
    assert "motorcycle" not in facts.allowed and "black" in facts.allowed
    agreed = describe_image(image, dets, np.array([0.0, 0.4, 0.6], np.float32), names, LAYOUT)
    assert agreed.values["vehicle_type"] == ["motorcycle"] and "motorcycle" in agreed.allowed


def test_text_attribute_parsing() -> None:
    a = parse_text_attributes("a person wearing a red and navy blue padded jacket", LAYOUT)
    assert a.top("upper") == ["red", "blue"] and a.top("lower") == []
    b = parse_text_attributes("a white van parked by the road", LAYOUT)
    assert b.top("domain") == ["vehicle"] and b.top("vehicle_type") == ["truck"]
    assert b.top("vehicle_colour") == ["white"]
    c = parse_text_attributes("a woman in black with a backpack", LAYOUT)
    assert c.top("upper") == ["black"] and c.top("lower") == ["black"] and c.top("objects") == ["backpack"]


# --- grounded captioner -----------------------------------------------------------------------

def test_ungrounded_sentences_and_their_tokens_are_removed() -> None:
    text = "The person wears a red top. He has long hair! The bottoms are navy."
    tokens = [TokenLogprob(t, -0.1 * (i + 1)) for i, t in enumerate(
        ["The", " person", " wears", " a", " red", " top", ".", " He", " has", " long", " hair", "!", " The",
         " bottoms", " are", " navy", "."])]
    kept, kept_tokens, dropped = keep_grounded(GenerationResult("r", text, tokens, "m"), {"red", "blue", "top"},
                                               CLAIMS)
    assert kept == "The person wears a red top. The bottoms are navy."  # navy = blue, a measured colour
    assert "".join(t.token for t in kept_tokens).strip() == kept
    assert len(dropped) == 1 and "['hair']" in dropped[0]
    assert ungrounded_words("a woman in a green dress", {"green"}, CLAIMS) == {"woman", "dress"}


def test_clause_pruning_and_pronoun_neutralisation() -> None:
    text = "She wears a red top and a green hat, with blue bottoms. His bag is white."
    tokens = [TokenLogprob(w, -0.2) for w in re.findall(r"\s*\S+", text)]
    kept, kept_tokens, dropped = keep_grounded(GenerationResult("r", text, tokens, "m"), {"red", "blue", "top"},
                                               CLAIMS)
    assert kept == "The person wears a red top, with blue bottoms."
    # tokens are kept by where they start: " hat," starts in the dropped clause, so its comma goes too
    assert "".join(t.token for t in kept_tokens).strip() == "She wears a red top with blue bottoms."
    assert any("['green', 'hat']" in d for d in dropped) and any("['bag', 'white']" in d for d in dropped)


class _ScriptedLlm:
    model_id = "scripted"

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.seen: list[GenerationRequest] = []

    def generate(self, requests):
        self.seen.extend(requests)
        return [GenerationResult(r.request_id, self.answer, [TokenLogprob(w, -0.5) for w in self.answer.split(" ")],
                                 "scripted") for r in requests]


def test_grounded_captioner_puts_facts_in_the_prompt_and_rejects_inventions(
        registry: ModelRegistry, person_crop: np.ndarray) -> None:
    spec = ModelSpec(backend="grounded", model_id="grounded-test")
    llm = _ScriptedLlm("The man has a beard and a green umbrella.")
    gen = GroundedCaptionGenerator(spec, registry.detector(), registry._bundled_embedder(), llm, DOMAINS)
    [res] = gen.generate([GenerationRequest("r1", [ChatMessage("user", "Describe the person.", [person_crop])])])
    system = llm.seen[0].messages[0].content
    assert "Image 1 (target): subject: a person" in system and "upper-body clothing colour" in system
    assert llm.seen[0].messages[0].images == [] and llm.seen[0].messages[1].images == []
    assert not res.ok and res.error.startswith("ungrounded")


def test_track_facts_reach_the_captioner_and_unmeasured_motion_is_removed(
        registry: ModelRegistry, person_crop: np.ndarray) -> None:
    """A request's image_facts (from the video track) are facts the captioner may state; a motion
    it was not given is an invention like an unmeasured colour."""
    spec = ModelSpec(backend="grounded", model_id="grounded-test")
    llm = _ScriptedLlm("The person is walking to the left. The person is running toward the camera.")
    gen = GroundedCaptionGenerator(spec, registry.detector(), registry._bundled_embedder(), llm, DOMAINS)
    track = {"motion": ["walking"], "direction": ["left"]}
    [res] = gen.generate([GenerationRequest("r1", [ChatMessage("user", "Describe the person.", [person_crop],
                                                               [track])])])
    system = llm.seen[0].messages[0].content
    assert "seen in the video: walking, to the left" in system
    assert res.ok and res.text == "The person is walking to the left.", res.text
    [facts] = gen.measured_facts([person_crop], [track])
    assert facts.values["motion"] == ["walking"] and {"walking", "left"} <= facts.allowed
    [bare] = gen.measured_facts([person_crop])
    assert "motion" not in bare.values and "walking" not in bare.allowed
    # a vehicle's "parked" is not a person's fact: dropped with its direction
    assert "motion" not in bare.with_track({"motion": ["parked"], "direction": ["left"]}).values
    # model backends read the facts as a line after the prompt
    assert ChatMessage("user", "Describe.", [person_crop], [track]).with_image_facts() == \
        "Describe.\nSeen in the video, image 1: walking, to the left."


def _crop_requests(pool_rows: dict[str, dict], count: int) -> list[GenerationRequest]:
    from rde.common.image_decoding import decode_rgb

    crops = [decode_rgb(r["image_bytes"]) for r in pool_rows.values() if r["variant"] == "crop"][:count]
    return [GenerationRequest(f"r{i}", [ChatMessage("user", "Describe the person.", [im])])
            for i, im in enumerate(crops)]


def test_measured_ahead_facts_equal_sequential(registry: ModelRegistry, pool_rows: dict[str, dict]) -> None:
    """Facts measured ahead on two threads: the same prompts and the same EfficientNet rows kept
    in the shared memo (bit for bit) as one request at a time."""
    requests = _crop_requests(pool_rows, 12)
    embedder = registry._bundled_embedder()
    memo = embedder._pooled_memo  # shared by every EfficientNet-Lite0 in the process
    images = [r.messages[0].images[0] for r in requests]
    seen, rows = [], []
    for threads in (1, 2):
        with memo._lock:
            memo._items.clear()
        llm = _ScriptedLlm("The person wears a top.")
        spec = ModelSpec(backend="grounded", model_id="grounded-test", options={"facts_threads": threads})
        GroundedCaptionGenerator(spec, registry.detector(), embedder, llm, DOMAINS).generate(requests)
        seen.append([m.content for r in llm.seen for m in r.messages])
        rows.append(memo.get_or_compute(embedder._memo_namespace, images, lambda _: pytest.fail("not remembered")))
    assert seen[0] == seen[1]
    assert all(np.array_equal(a, b) for a, b in zip(*rows, strict=True))


def test_facts_are_measured_ahead_one_request_per_call_on_threads(registry: ModelRegistry,
                                                                   pool_rows: dict[str, dict]) -> None:
    requests = _crop_requests(pool_rows, 6)
    calls: list[tuple[str, int]] = []
    running, most = [0], [0]
    lock = threading.Lock()
    gen = GroundedCaptionGenerator(ModelSpec(backend="grounded", model_id="grounded-test"), registry.detector(),
                                   registry._bundled_embedder(), _ScriptedLlm("The person wears a top."), DOMAINS)
    real = gen.facts
    overlapped = threading.Event()  # set once two calls are in flight at once

    def counting(images: list[np.ndarray]):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            calls.append((threading.current_thread().name, len(images)))
            first = len(calls) == 1
            if running[0] == 2:
                overlapped.set()
        if first:  # in flight until a second call joins it (a thread starts in ms; 10 s: a loaded machine)
            overlapped.wait(10)
        try:
            return real(images)
        finally:
            with lock:
                running[0] -= 1

    gen.facts = counting
    gen.generate(requests)
    assert [n for _, n in calls] == [1] * 6  # one request's images per call, each image once
    assert most[0] == 2 and len({name for name, _ in calls}) == 2


class _TeacherForcedLlm:
    """A text Generator whose reply is fixed: the real LLM's ``score`` of ``reply`` (its token
    log-probabilities under each request's prompt), so that what follows does not depend on what
    the model would decode (which can differ between CPUs)."""

    def __init__(self, llm, reply: str) -> None:
        self.llm, self.reply, self.model_id = llm, reply, llm.model_id

    def generate(self, requests):
        return self.llm.score(requests, [self.reply] * len(requests))


def _pieces(llm, text: str) -> list[str]:
    """``text``'s tokens as strings, split by the GGUF's own BPE (ASCII text: one piece per id)."""
    from models.backends.llama_cpp_generator import gguf_bpe_tokenizer

    tokenizer = gguf_bpe_tokenizer(llm.gguf_path)
    return [tokenizer.decode([i]) for i in llm.tokenize(text)]


def _assert_same_greedy_path(a: GenerationResult, b: GenerationResult, tol: float = 1e-3) -> None:
    """Two greedy decodings of one request whose logits may differ in the last bits (computed over
    another prompt split: a reused prompt cache, another context): the same tokens with
    log-probabilities within ``tol`` up to where they part, if they part, and there only at a
    near-tie: each run took its own argmax, so the two chosen tokens' log-probabilities (each
    run's largest) are within ``tol`` too. Past that point the texts go their own way. A run on a
    wrong prompt or a stale cache differs by far more than ``tol`` (real rounding: < 1e-4)."""
    assert a.ok and b.ok, (a.error, b.error)
    for x, y in zip(a.tokens, b.tokens, strict=False):
        assert abs(x.logprob - y.logprob) < tol, (a.text, b.text, x, y)
        if x.token != y.token:
            return
    assert len(a.tokens) == len(b.tokens) and a.text == b.text, (a.text, b.text)


@pytest.mark.slow
def test_grounded_captioner_with_real_smollm2(registry: ModelRegistry, person_crop: np.ndarray) -> None:
    """Whatever SmolLM2 decodes (which can differ between CPUs) comes out grounded, or as an
    "ungrounded" error; a fixed reply through the real model keeps exactly its grounded sentence,
    with that sentence's token probabilities."""
    gen = registry.generator(load_profile("demo").models.generators[0])
    requests = [GenerationRequest(f"r{i}", [ChatMessage("user", q, [person_crop])], max_tokens=60)
                for i, q in enumerate(["Describe the clothing of the person in one sentence.",
                                       "What colour is the person's top?"])]
    facts = gen.facts([person_crop])[0]
    for res in gen.generate(requests):
        if res.ok:
            assert res.text and ungrounded_words(res.text, facts.allowed, CLAIMS) == set()
            assert 0 < res.mean_token_probability <= 1
        else:
            assert res.error.startswith("ungrounded"), res.error
    # a measured top colour when there is one ("top" alone is always allowed); gender, beards never are
    kept = f"The person wears a {' '.join([*facts.values['top'][:1], 'top'])}."
    forced = GroundedCaptionGenerator(gen.spec, gen.detector, gen.embedder,
                                      _TeacherForcedLlm(gen.llm, kept + " The man has a beard."), DOMAINS)
    [res] = forced.generate(requests[:1])
    assert res.ok and res.text == kept, (res.text, res.error)
    assert [t.token for t in res.tokens] == _pieces(gen.llm, kept)  # the dropped sentence's are gone
    assert 0 < res.mean_token_probability < 1


@pytest.mark.slow
def test_llama_cpp_generator_real_smollm2() -> None:
    """Greedy decoding is deterministic: a fresh generator repeats another's reply exactly. A second
    call on the same one reuses the prompt its context's cache holds, so its logits come from
    another split: the same reply up to a near-tie (``_assert_same_greedy_path``)."""
    from models.backends.llama_cpp_generator import LlamaCppGenerator

    spec = ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct")
    gen = LlamaCppGenerator(spec)
    req = GenerationRequest("a", [ChatMessage("user", "Name a colour.")], max_tokens=12)
    [first], [again] = gen.generate([req]), gen.generate([req])
    [fresh] = LlamaCppGenerator(spec).generate([req])
    assert first.ok and (fresh.text, fresh.tokens) == (first.text, first.tokens)
    _assert_same_greedy_path(first, again)
    assert len(first.tokens) > 0 and all(t.logprob <= 0 for t in first.tokens)
    [with_image] = gen.generate([GenerationRequest("b", [ChatMessage("user", "x", [np.zeros((4, 4, 3), np.uint8)])])])
    assert with_image.error == "unsupported: this generator does not take images"


@pytest.mark.slow
def test_llama_cpp_generator_honours_a_gbnf_grammar() -> None:
    from models.backends.llama_cpp_generator import LlamaCppGenerator

    gen = LlamaCppGenerator(ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct"))
    grammar = 'root ::= ("teal" | "ochre") " coat"'
    [res] = gen.generate([GenerationRequest("g", [ChatMessage("user", "Name a colour.")], max_tokens=8,
                                            temperature=0.8, seed=1, grammar=grammar)])
    assert res.ok and res.text in {"teal coat", "ochre coat"}, res.text


@pytest.fixture(scope="module")
def smollm2():
    from models.backends.llama_cpp_generator import LlamaCppGenerator

    return LlamaCppGenerator(ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct"))


@pytest.mark.slow
def test_llama_cpp_tokenizer_from_the_gguf_splits_as_the_model_does(smollm2) -> None:
    """The GGUF's BPE gives the ids of llama.cpp's own vocabulary: a text forced as those ids comes
    back token for token as the pieces the BPE names them (and, as text, as many tokens as
    llama.cpp counts). A fixed text, not a generated one: what the model decodes differs between CPUs."""
    text = "The person wears a purple giraffe hat, 1234 pixels wide."
    [res] = smollm2.score([GenerationRequest("t", [ChatMessage("user", "Name two colours.")])], [text])
    emitted = [t.token for t in res.tokens if t.token]  # "": the end-of-turn token after the text
    assert res.ok and res.text == text and emitted == _pieces(smollm2, text)
    assert len(emitted) == len(smollm2.tokenize(text)) == 16  # each digit its own token
    for text in ("The person wears a purple giraffe hat.", "It's 1234 pixels, naïve — ok?\n  Two  spaces."):
        with smollm2.context() as server:
            counted = server.handle_completions({"prompt": text, "n_predict": 1})["usage"]["prompt_tokens"]
        assert len(smollm2.tokenize(text)) == counted


@pytest.mark.slow
def test_llama_cpp_teacher_forcing_reproduces_greedy_logprobs_and_penalises_unlikely_text(smollm2) -> None:
    """Forcing the model's own greedy reply gives its generation log-probabilities (the raw
    distribution, not the post-grammar one where every forced token has probability 1); a forced
    unlikely text scores a clearly lower mean probability (Eq. 8) than a forced plausible one. The
    two are fixed texts: the greedy reply differs between CPUs, and so would its mean."""
    system = ChatMessage("system", "Facts: upper-body clothing colour: black; lower-body clothing colour: blue")
    req = GenerationRequest("g", [system, ChatMessage("user", "Describe the person's clothing in one sentence.")],
                            max_tokens=40)
    [gen] = smollm2.generate([req])
    [forced] = smollm2.score([req], [gen.text])
    assert gen.ok and forced.ok and forced.text == gen.text
    # the forced reply ends with its end-of-turn token; a reply cut at max_tokens has none
    assert len(forced.tokens) == len(gen.tokens) + (gen.finish_reason == "length")
    assert [t.token for t in forced.tokens[:len(gen.tokens)]] == [t.token for t in gen.tokens]
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(gen.tokens, forced.tokens, strict=False)]
    assert max(diffs) < 1e-3, diffs
    [plain] = smollm2.score([req], ["The person's clothing is black and blue."])
    assert plain.ok and any(t.logprob < -0.05 for t in plain.tokens)  # not the post-sampling ones (all 0)
    [odd] = smollm2.score([req], ["The person wears a purple giraffe hat and sings loudly."])
    # measured 0.259 vs 0.476 (0.12 beyond the 0.1 asked); another CPU's rounding moves each < 1e-3. The
    # model's own opening ("The person's clothing is") makes the plausible text's mean: "The person
    # wears a black top and blue bottoms." scores 0.317, too close to the odd text for a clear margin
    assert odd.ok and odd.mean_token_probability < plain.mean_token_probability - 0.1
    assert [t.token for t in odd.tokens][4] == " purple" and odd.tokens[4].logprob < -5  # one token, unlikely (-7.5)
    [bad] = smollm2.score([req], [""])
    assert not bad.ok


@pytest.mark.slow
def test_llama_cpp_contexts_answer_a_batch_at_once_the_same_way_every_run() -> None:
    """Two contexts answer a batch concurrently: results in request order, the same texts and
    logprobs on every run (contiguous runs, run k on context k), and one context's replies token
    for token up to where a near-tie may flip (the class docstring says why; how often depends on
    the CPU's rounding, so no count of equal texts is asked); teacher-forced scores likewise."""
    from models.backends.llama_cpp_generator import LlamaCppGenerator

    colours = ["red", "blue", "black", "white", "gray", "green"]
    system = ChatMessage("system", "Describe the person in one sentence from the facts.")
    reqs = [GenerationRequest(f"r{i}", [system, ChatMessage("user", f"Facts: top {c}, bottoms {colours[i - 1]}.")],
                              max_tokens=24) for i, c in enumerate(colours)]
    spec = ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct")
    one = LlamaCppGenerator(spec)
    two = LlamaCppGenerator(spec.model_copy(update={"options": {"contexts": 2}}))
    assert two.parallel_requests == 2 and one.parallel_requests == 1

    def seen(results):
        return [(r.request_id, r.text, [(t.token, t.logprob) for t in r.tokens]) for r in results]

    alone, answered = one.generate(reqs), two.generate(reqs)
    first = seen(answered)
    assert len(two._servers) == 2
    assert [rid for rid, *_ in first] == [r.request_id for r in reqs]
    assert seen(LlamaCppGenerator(two.spec).generate(reqs)) == first  # a fresh generator, same results
    assert len({text for _, text, _ in first}) > 3  # different requests, different answers
    for a, b in zip(alone, answered, strict=True):  # each the one context's reply, unless a near-tie flips
        _assert_same_greedy_path(a, b)
    texts = [text for _, text, _ in first]
    forced = seen(two.score(reqs, texts))
    assert [text for _, text, _ in forced] == texts and seen(LlamaCppGenerator(two.spec).score(reqs, texts)) == forced


class _ScoringLlm(_ScriptedLlm):
    def score(self, requests, texts):
        self.seen.extend(requests)
        return [GenerationResult(r.request_id, t, [*(TokenLogprob(w, -0.1) for w in t.split(" ")),
                                                   TokenLogprob("", -2.0)], "scripted")  # "": end of turn
                for r, t in zip(requests, texts, strict=True)]


def test_grounded_captioner_scores_under_the_request_generate_sends(registry: ModelRegistry,
                                                                     person_crop: np.ndarray) -> None:
    spec = ModelSpec(backend="grounded", model_id="grounded-test")
    llm = _ScoringLlm("The person wears a top.")
    gen = GroundedCaptionGenerator(spec, registry.detector(), registry._bundled_embedder(), llm, DOMAINS)
    req = GenerationRequest("r1", [ChatMessage("user", "Describe the person.", [person_crop])], max_tokens=30)
    qa = GenerationRequest("r2", [ChatMessage("user", "Ask.", [person_crop])], expects="qa_pairs")
    gen.generate([req])
    scored, from_facts = gen.score([req, qa], ["A purple coat.", "Q1: x"])
    generated, forced = llm.seen
    assert [(m.role, m.content) for m in forced.messages] == [(m.role, m.content) for m in generated.messages]
    assert scored.ok and scored.text == "A purple coat." and scored.model_id == gen.model_id
    # no grounding filter on a given text; the end-of-turn token is not counted, as in generate's q_txt
    assert len(scored.tokens) == 3 and scored.mean_token_probability == pytest.approx(math.exp(-0.1))
    assert not from_facts.ok and "answered from the facts" in from_facts.error
    plain = GroundedCaptionGenerator(spec, registry.detector(), registry._bundled_embedder(), _ScriptedLlm("x"),
                                     DOMAINS)
    with pytest.raises(NotImplementedError, match="_ScriptedLlm"):
        plain.score([req], ["x"])


def test_openai_http_sends_the_grammar_only_in_the_configured_field() -> None:
    from openai_stub import StubServer

    from models.backends.generators import OpenAIHttpGenerator

    req = GenerationRequest("g", [ChatMessage("user", "ok")], max_tokens=8, grammar='root ::= "a"')
    with StubServer() as server:
        for field in (None, "grammar", "structured_outputs.grammar"):
            options = {"base_url": server.base_url, **({"grammar_field": field} if field else {})}
            [res] = OpenAIHttpGenerator(ModelSpec(backend="openai-http", model_id="m", options=options)).generate([req])
            assert res.ok
        plain, llama, vllm = server.state.bodies
    assert "grammar" not in plain and "structured_outputs" not in plain  # not configured: ignored
    assert llama["grammar"] == 'root ::= "a"' and vllm["structured_outputs"] == {"grammar": 'root ::= "a"'}


# --- production backends on tiny models --------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-models")
    build_tiny_dinov2(root / "dinov2")
    build_tiny_clip(root / "clip")
    build_tiny_qwen2vl(root / "qwen2vl")
    return root


def test_transformers_dinov2_embedder(tiny_dir: Path) -> None:
    from models.backends.image_embedders import TransformersImageEmbedder

    emb = TransformersImageEmbedder(ModelSpec(backend="transformers", model_id=str(tiny_dir / "dinov2"), batch_size=2))
    images = random_images(5)
    vecs = emb.embed(images)
    assert vecs.shape == (5, 48) and np.allclose(_norms(vecs), 1, atol=1e-5)
    assert np.allclose(vecs[3], emb.embed([images[3]])[0], atol=1e-5)  # batching does not change results
    assert emb.feature_maps(images[:2]).shape == (2, 16, 48)  # 56/14 = 4 → 4x4 patches, CLS removed


def test_transformers_clip_expert(tiny_dir: Path) -> None:
    from models.backends.experts import TransformersClipExpert

    expert = TransformersClipExpert(ModelSpec(backend="transformers-clip", model_id=str(tiny_dir / "clip"),
                                              batch_size=2))
    txt = expert.encode_text(["a red jacket", "a white van", "a person"])
    img = expert.encode_image(random_images(3))
    assert txt.shape == (3, 16) and img.shape == (3, 16)
    assert np.allclose(_norms(txt), 1, atol=1e-5) and np.allclose(_norms(img), 1, atol=1e-5)


def test_vlm_embedding_expert_and_vlm_generator(tiny_dir: Path) -> None:
    from models.backends.experts import VlmEmbeddingExpert
    from models.backends.generators import TransformersVlmGenerator

    spec = ModelSpec(backend="vlm-embedding", model_id=str(tiny_dir / "qwen2vl"), batch_size=2)
    expert = VlmEmbeddingExpert(spec)
    images = random_images(3)
    assert expert.encode_image(images).shape == (3, 64) and expert.encode_text(["a red jacket"]).shape == (1, 64)
    gen = TransformersVlmGenerator(spec.model_copy(update={"backend": "transformers-vlm"}))
    results = gen.generate([
        GenerationRequest("one", [ChatMessage("user", "describe the person", [images[0]])], max_tokens=6),
        GenerationRequest("two", [ChatMessage("user", "compare", [images[1], images[2]])], max_tokens=6),
        GenerationRequest("text", [ChatMessage("user", "a white van")], max_tokens=4),
    ])
    assert [r.request_id for r in results] == ["one", "two", "text"]
    for res in results:
        assert res.ok and 0 < len(res.tokens) <= 6 and all(t.logprob <= 0 for t in res.tokens)
        assert 0 < res.mean_token_probability <= 1


def test_a_text_only_llm_generates_through_transformers_vlm(tmp_path: Path) -> None:
    """Production's text LLM (a Qwen3: query_generator, template_generator) on a CPU: the
    ``transformers-vlm`` backend loads a text-only causal LM through AutoModelForCausalLM, its
    messages as plain strings; an image sent to it is a failed request, not an exception."""
    from models.backends.generators import TransformersVlmGenerator

    gen = TransformersVlmGenerator(ModelSpec(backend="transformers-vlm", batch_size=2,
                                             model_id=str(build_tiny_qwen3(tmp_path / "qwen3"))))
    assert gen.text_only and type(gen.model).__name__ == "Qwen3ForCausalLM"
    asked = [GenerationRequest("one", [ChatMessage("system", "be brief"), ChatMessage("user", "a white van")],
                               max_tokens=5),
             GenerationRequest("two", [ChatMessage("user", "describe the person")], max_tokens=5),
             GenerationRequest("three", [ChatMessage("user", "the man carries a backpack")], max_tokens=5)]
    prompt = gen.tokenizer.decode(gen._inputs(asked[:1])["input_ids"][0], skip_special_tokens=False)
    assert "be brief" in prompt and "a white van" in prompt  # the content as a string, not dropped
    results = gen.generate(asked)
    assert [r.request_id for r in results] == ["one", "two", "three"]
    for res in results:
        assert res.ok and 0 < len(res.tokens) <= 5 and all(t.logprob <= 0 for t in res.tokens)
    assert gen.generate([asked[2]])[0].text == results[2].text  # greedy: the batch does not change it
    [failed] = gen.generate([GenerationRequest("img", [ChatMessage("user", "x", random_images(1))], max_tokens=3)])
    assert not failed.ok and "text-only" in failed.error


def test_production_ids_fail_fast_offline_with_a_hint() -> None:
    from models.backends.image_embedders import TransformersImageEmbedder

    with pytest.raises(ModelLoadError, match=r"could not load 'facebook/dinov2-large'.*local folder"):
        TransformersImageEmbedder(ModelSpec(backend="transformers", model_id="facebook/dinov2-large"))


def test_unknown_backend_is_a_profile_error() -> None:
    with pytest.raises(ProfileError, match=r"models\.experts\[0\]\.backend 'clip-magic'"):
        load_profile("demo", {"models": {"experts": [{"backend": "clip-magic", "model_id": "x"}]}})


def test_a_composed_backends_lineage_names_the_parts_it_is_built_from() -> None:
    """The semantic-bridge and attribute experts and the grounded captioner run the profile's
    detector: its threshold is in their lineage (and so in MECF's, evaluate's and caption-pool's
    keys); a speed-only field (memo_items) is not; a plain backend has no parts. The attribute
    expert and the grounded captioner measure the profile's domains: their files are in the lineage."""
    models = load_profile("demo").models
    bridge, attributes = models.experts
    base = ModelRegistry(models, DOMAINS)
    stricter = ModelRegistry(models.model_copy(update={"detector": models.detector.model_copy(
        update={"score_threshold": 0.7})}), DOMAINS)
    roomier = ModelRegistry(models.model_copy(update={"detector": models.detector.model_copy(
        update={"memo_items": 16})}), DOMAINS)
    for spec in (bridge, attributes, models.generators[0]):
        assert base.lineage(spec)["parts"]["detector"]["score_threshold"] == 0.5
        assert stricter.lineage(spec) != base.lineage(spec) and roomier.lineage(spec) == base.lineage(spec)
    pedestrians_only = ModelRegistry(models, load_domains(["pedestrian"]))
    for spec in (attributes, models.generators[0]):
        assert pedestrians_only.lineage(spec)["domains"] != base.lineage(spec)["domains"]
    assert pedestrians_only.lineage(bridge) == base.lineage(bridge)
    assert set(base.lineage(bridge)["parts"]) == {"image_embedder", "detector", "text_encoder"}
    assert set(base.lineage(attributes)["parts"]) == {"detector"}
    llm = ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct")
    assert "parts" not in base.lineage(llm)

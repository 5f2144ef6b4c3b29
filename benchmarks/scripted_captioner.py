"""A fast, deterministic stand-in for the captioning MLLM of ``build-largefine`` (benchmarks only).

An OpenAI-compatible ``/v1/chat/completions`` server on 127.0.0.1 that the product reaches through
its own ``openai-http`` generator backend (no product code knows about it): no model, no LLM. It
recognises each prompt of ``prompts/gtr_tiers.yaml`` (base/inter Q&A, base/inter summaries, the
advanced tier) and of ``prompts/gtr_template_gallery.yaml`` (extract, expand) by the first line of
its template, and answers in the form the tier checks expect:

- Q&A prompts: five or six numbered ``Q<n>:``/``A<n>:`` pairs (``min_qa_pairs`` is 2);
- summaries: one paragraph of 20-40 words built from the person's attributes; one intermediate
  summary in four ends with a contrast clause about the Compare-Image and one summary in eight
  starts with "In the image," so the cleaning steps (negative mentions, boilerplate) run too;
- the advanced tier: the template in the prompt with every ``[slot]`` filled, plus one sentence;
- the gallery: numbered templates with slots from the vocabulary, written as caption patterns.

A person's attributes are a function of the image alone (a hash of the first attached image's
JPEG data URL, which the client encodes deterministically), so T_base, T_inter and T_adv of one
image agree with each other. Token log-probabilities: one token per word, each with a probability
in [0.55, 0.98] derived from the text, so q_txt (GTR+ Eq. 8) varies between captions.

The captions are for load, not for quality: they say nothing about the image's pixels.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from models.prompt_files import load_prompt

TIER_PROMPT = "gtr_tiers"
GALLERY_PROMPT = "gtr_template_gallery"

GENDERS = (("man", "He", "his"), ("woman", "She", "her"))
AGES = ("young adult", "middle-aged", "teenage", "elderly")
AGE_NOUNS = {"young adult": "a young adult", "middle-aged": "a middle-aged adult", "teenage": "a teenager",
             "elderly": "an elderly person"}
AGE_PHRASES = {"young adult": "about twenty-five", "middle-aged": "middle age", "teenage": "about sixteen",
               "elderly": "advanced age"}
COLOURS = ("black", "white", "gray", "navy blue", "red", "dark green", "beige", "brown", "light blue")
TOPS = ("jacket", "long-sleeved shirt", "T-shirt", "hooded sweatshirt", "wool coat", "knitted sweater")
BOTTOMS = ("trousers", "jeans", "knee-length skirt", "shorts", "cargo pants")
SHOES = ("sneakers", "leather shoes", "ankle boots", "sandals", "running shoes")
HAIR = ("short dark hair", "long brown hair", "a ponytail", "short gray hair", "curly black hair", "a shaved head")
BELONGINGS = ("a black backpack", "a shoulder bag", "a plastic shopping bag", "a folded umbrella",
              "a paper folder", "nothing in the hands")
ACCESSORIES = ("a wristwatch", "dark sunglasses", "a knitted scarf", "a baseball cap", "no visible accessories")
POSTURES = ("a straight back", "a relaxed stride", "the head turned aside", "both arms at the sides")
# Caption patterns in the gallery's slot vocabulary, different from the prompt file's seeds.
TEMPLATES = (
    "The [person/man/woman] is dressed in [top description] and [bottom description], with [footwear description].",
    "Carrying [belongings description], the [person/man/woman] wears [clothing description].",
    "A [person/man/woman] with [hair description] walks by in [top description] and [shoes description].",
    "This [person/man/woman] of [age description] wears [top description] over [bottom description].",
    "The [person/man/woman] wears [accessories description] and is dressed in [clothing description].",
    "Walking with [posture description], the [person/man/woman] wears [top description].",
    "The [person/man/woman] has [hair description] and carries [belongings description].",
    "Dressed in [clothing description], the [person/man/woman] walks with [posture description].",
    "A [person/man/woman] in [colour description] clothing wears [footwear description] and carries "
    "[belongings description].",
    "The [person/man/woman] is seen wearing [top description], [bottom description] and [accessories description].",
    "With [belongings description] in hand, the [person/man/woman] wears [clothing description].",
    "The [person/man/woman] of [age description] has [hair description] and wears [shoes description].",
)


def _digest(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest(), "big")


def _pick(options: tuple[str, ...], key: str, what: str) -> str:
    return options[_digest(key, what) % len(options)]


def attributes(key: str) -> dict[str, str]:
    """The person of an image: every attribute a function of ``key`` (the image's digest)."""
    gender, pronoun, possessive = GENDERS[_digest(key, "gender") % 2]
    top_colour, bottom_colour = _pick(COLOURS, key, "top colour"), _pick(COLOURS, key, "bottom colour")
    shoe_colour = _pick(("black", "white", "brown", "gray"), key, "shoe colour")
    return {"gender": gender, "pronoun": pronoun, "possessive": possessive, "age": _pick(AGES, key, "age"),
            "top": f"a {top_colour} {_pick(TOPS, key, 'top')}", "top_colour": top_colour,
            "bottom": f"{bottom_colour} {_pick(BOTTOMS, key, 'bottom')}", "bottom_colour": bottom_colour,
            "shoes": f"{shoe_colour} {_pick(SHOES, key, 'shoes')}", "hair": _pick(HAIR, key, "hair"),
            "belongings": _pick(BELONGINGS, key, "belongings"), "accessories": _pick(ACCESSORIES, key, "accessories"),
            "posture": _pick(POSTURES, key, "posture")}


def base_qa(a: dict[str, str], key: str) -> str:
    pairs = [("What is the gender of the person?", f"The person appears to be a {a['gender']}."),
             ("How old does the person look?", f"The person looks like {AGE_NOUNS[a['age']]}."),
             ("What is the person wearing on the top?", f"{a['top'].capitalize()}."),
             ("What is the person wearing on the bottom?", f"{a['bottom'].capitalize()}."),
             ("What shoes does the person wear?", f"{a['shoes'].capitalize()}."),
             ("What is the person's hairstyle?", f"{a['hair'].capitalize()}."),
             ("What is the person carrying?", f"{a['belongings'].capitalize()}.")]
    keep = 5 + _digest(key, "qa count") % 3  # five to seven pairs
    return "\n".join(f"Q{i}: {q}\nA{i}: {ans}" for i, (q, ans) in enumerate(pairs[:keep], 1))


def inter_qa(a: dict[str, str], b: dict[str, str]) -> str:
    same = a["top_colour"] == b["top_colour"]
    pairs = [("Are both persons of the same gender?",
              "Yes, both are " + a["gender"] + "s." if a["gender"] == b["gender"]
              else f"No, the target is a {a['gender']} and the other person is a {b['gender']}."),
             ("Do they wear the same colour on the top?",
              f"{'Yes' if same else 'No'}, the target wears {a['top']} and the other person wears {b['top']}."),
             ("How do their bottoms differ?", f"The target wears {a['bottom']}, the other person {b['bottom']}."),
             ("What shoes does the target wear?", f"{a['shoes'].capitalize()}."),
             ("What does the target carry?", f"{a['belongings'].capitalize()}; the other person carries "
                                             f"{b['belongings']}.")]
    return "\n".join(f"Q{i}: {q}\nA{i}: {ans}" for i, (q, ans) in enumerate(pairs, 1))


def base_summary(a: dict[str, str], key: str) -> str:
    text = (f"The {a['gender']} is {AGE_NOUNS[a['age']]} wearing {a['top']}, {a['bottom']} and {a['shoes']}. "
            f"{a['pronoun']} has {a['hair']} and carries {a['belongings']}.")
    if _digest(key, "boilerplate") % 8 == 0:
        text = "In the image, " + text[0].lower() + text[1:]
    return text


def inter_summary(a: dict[str, str], b: dict[str, str], key: str) -> str:
    text = (f"The {a['gender']} wears {a['top']} with {a['bottom']} and {a['shoes']}, "
            f"and {a['possessive']} {a['hair'].removeprefix('a ')} is clearly visible. "
            f"{a['pronoun']} carries {a['belongings']} and shows {a['accessories']}.")
    if _digest(key, "contrast") % 4 == 0:  # a clause about the hard negative: cut by the negative-mention gate
        text = text[:-1] + f", while the person in the Compare-Image wears {b['top']}."
    return text


def fill_template(template: str, a: dict[str, str]) -> str:
    values = {"person/man/woman": a["gender"], "clothing description": f"{a['top']} and {a['bottom']}",
              "top description": a["top"], "bottom description": a["bottom"], "footwear description": a["shoes"],
              "shoes description": a["shoes"], "hair description": a["hair"],
              "belongings description": a["belongings"], "accessories description": a["accessories"],
              "age description": AGE_PHRASES[a["age"]], "colour description": a["top_colour"],
              "posture description": a["posture"]}
    text = re.sub(r"\[([^\[\]]+)\]", lambda m: values.get(" ".join(m.group(1).lower().split()), "clothes"), template)
    return text[0].upper() + text[1:] if text else text


def advanced(template: str, a: dict[str, str]) -> str:
    return (fill_template(template, a).rstrip(".") + ". "
            + f"{a['pronoun']} also has {a['hair']} and wears {a['shoes']}.")


def token_logprobs(text: str, key: str) -> list[dict[str, Any]]:
    """One token per word; p in [0.55, 0.98], a function of the word and its position."""
    out = []
    for i, word in enumerate(text.split()):
        p = 0.55 + 0.43 * (_digest(key, str(i), word) % 1000) / 999
        out.append({"token": (" " if i else "") + word, "logprob": math.log(p), "top_logprobs": []})
    return out


def _worded(body: str, wording: dict[str, str]) -> str:
    """A template with the subject's words filled in (the tier prompt's default, people's): two
    templates may differ only after them."""
    for key, value in wording.items():
        body = body.replace("{" + key + "}", value)
    return body


class ScriptedCaptioner:
    """The answering logic, without HTTP: ``answer(text, image_urls, seed)`` → (kind, reply text)."""

    def __init__(self) -> None:
        tiers, gallery = load_prompt(TIER_PROMPT), load_prompt(GALLERY_PROMPT)
        self.signatures = [(name, _worded(body, prompt.extras.get("wording", {})).splitlines()[0].split("{")[0].strip())
                           for prompt in (tiers, gallery) for name, body in prompt.templates.items()]

    def kind(self, text: str) -> str:
        first = text.lstrip().splitlines()[0] if text.strip() else ""
        for name, signature in self.signatures:
            if signature and first.startswith(signature):
                return name
        return "unknown"

    def answer(self, text: str, image_urls: list[str], seed: int | None) -> tuple[str, str]:
        kind = self.kind(text)
        key = hashlib.blake2b(image_urls[0].encode(), digest_size=16).hexdigest() if image_urls else str(seed)
        a = attributes(key)
        if kind == "base_qa":
            return kind, base_qa(a, key)
        if kind == "base_sum":
            return kind, base_summary(a, key)
        other = attributes(hashlib.blake2b(image_urls[1].encode(), digest_size=16).hexdigest()) \
            if len(image_urls) > 1 else attributes(key + "#other")
        if kind == "inter_qa":
            return kind, inter_qa(a, other)
        if kind == "inter_sum":
            return kind, inter_summary(a, other, key)
        if kind == "adv":
            found = re.search(r"following template:\s*(.*?)\n", text)
            return kind, advanced(found.group(1) if found else TEMPLATES[0], a)
        if kind in ("extract", "expand"):
            start = (seed or 0) % len(TEMPLATES)
            chosen = [TEMPLATES[(start + i) % len(TEMPLATES)] for i in range(6)]
            return kind, "\n".join(f"{i}. {t}" for i, t in enumerate(chosen, 1))
        return kind, f"The {a['gender']} wears {a['top']}, {a['bottom']} and {a['shoes']}, and carries " \
                     f"{a['belongings']}."


def _handler(captioner: ScriptedCaptioner, counts: Counter[str], lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            content = body["messages"][-1]["content"]
            if isinstance(content, str):
                text, urls = content, []
            else:
                text = next((p["text"] for p in reversed(content) if p.get("type") == "text"), "")
                urls = [p["image_url"]["url"] for p in content if p.get("type") == "image_url"]
            kind, reply = captioner.answer(text, urls, body.get("seed"))
            with lock:
                counts[kind] += 1
            payload = json.dumps({"id": "scripted", "object": "chat.completion", "model": body.get("model"),
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": reply},
                                               "logprobs": {"content": token_logprobs(reply, kind + reply)}}]})
            data = payload.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away (its process ended) is not an error of the benchmark: counted, not printed."""
        self.errors = getattr(self, "errors", 0) + 1


class ScriptedServer:
    """``with ScriptedServer() as s: s.spec()`` — a running server and the generator spec for it."""

    def __enter__(self) -> ScriptedServer:
        self.counts: Counter[str] = Counter()
        self.httpd = _Server(("127.0.0.1", 0), _handler(ScriptedCaptioner(), self.counts, threading.Lock()))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def spec(self, concurrency: int = 8) -> dict[str, Any]:
        """``models.generators[0]`` / ``models.template_generator`` for a profile override."""
        return {"backend": "openai-http", "model_id": "scripted-captioner", "batch_size": 64,
                "options": {"base_url": self.base_url, "timeout_s": 60, "max_retries": 2,
                            "max_concurrency": concurrency}}

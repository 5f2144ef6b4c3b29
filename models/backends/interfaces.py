"""The small, batched, typed interfaces every model backend implements.

Stages depend on these only; a profile names the implementation (``models/backends/registry.py``).
Images are RGB ``uint8`` arrays (H×W×3); vectors are ``float32`` and L2-normalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


def l2_normalize(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float32)
    norm = np.linalg.norm(x, axis=axis, keepdims=True)
    return x / np.maximum(norm, 1e-12)


@runtime_checkable
class ImageEmbedder(Protocol):
    """Images → L2-normalised vectors; optionally the patch/feature map (cached reranker input)."""

    model_id: str
    dim: int
    preprocessing: str  # a short description that enters embedding cache keys

    def embed(self, images: list[np.ndarray]) -> np.ndarray: ...

    def feature_maps(self, images: list[np.ndarray]) -> np.ndarray:
        """N×P×d patch features (P patches of width d)."""
        ...


@runtime_checkable
class TextEncoder(Protocol):
    """Texts → L2-normalised vectors (query dedup, statistics, reranker initialisation)."""

    model_id: str
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


@runtime_checkable
class TextImageExpert(Protocol):
    """Texts and images in one shared space (retrieval experts, the SAFT teacher)."""

    model_id: str
    dim: int
    preprocessing: str

    def encode_text(self, texts: list[str]) -> np.ndarray: ...

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray: ...


@dataclass
class ChatMessage:
    """One chat turn; ``images`` are attached to this turn (for multimodal generators).
    ``image_facts`` (empty, or one dict per image) are facts about an image that its pixels do not
    show, measured from its video track (``models.backends.track_facts``: motion, direction,
    distance); a model backend reads them as a line of text after the turn's content
    (``with_image_facts``), the grounded captioner as measured facts it may state."""

    role: str
    content: str
    images: list[np.ndarray] = field(default_factory=list)
    image_facts: list[dict[str, list[str]]] = field(default_factory=list)

    def with_image_facts(self) -> str:
        """The content, followed by one line per image with track facts ("Seen in the video, image
        1: walking, to the left.")."""
        from models.backends.track_facts import facts_phrase

        lines = [f"Seen in the video, image {i}: {facts_phrase(f)}." for i, f in enumerate(self.image_facts, 1)
                 if facts_phrase(f)]
        return "\n".join([self.content, *lines])


@dataclass
class GenerationRequest:
    """A chat request. ``request_id`` ties the result back to the row that asked. ``expects`` names
    the answer's shape (e.g. ``qa_pairs``): model backends ignore it; composed backends such as the
    offline grounded captioner may answer such a request from measurements instead. ``grammar``
    constrains decoding where the backend can (see the field)."""

    request_id: str
    messages: list[ChatMessage]
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    expects: str | None = None
    # A GBNF grammar the output must follow (llama.cpp syntax). Honoured by ``llama-cpp`` and by
    # ``openai-http`` when its ``grammar_field`` option names the server's field; others ignore it.
    grammar: str | None = None


@dataclass
class TokenLogprob:
    token: str
    logprob: float


@dataclass
class GenerationResult:
    """Text plus per-token log-probabilities; ``error`` is set (and text empty) when the call failed."""

    request_id: str
    text: str
    tokens: list[TokenLogprob]
    model_id: str
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def mean_token_probability(self) -> float | None:
        """q_txt (GTR+ Eq. 8): the arithmetic mean of the generated tokens' probabilities,
        (1/L)·Σ exp(log p_l) — not the joint product, which would punish long captions."""
        if not self.tokens:
            return None
        return float(sum(math.exp(t.logprob) for t in self.tokens) / len(self.tokens))


@runtime_checkable
class Generator(Protocol):
    """Batched chat generation with token log-probabilities. Never raises for one bad request:
    each request gets a result, failed ones with ``error`` set."""

    model_id: str

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...


def parallel_requests(generator: Generator) -> int:
    """How many requests ``generator`` answers at once (its ``parallel_requests`` attribute; 1 when it
    has none), so a caller with requests that do not depend on each other can hand over that many."""
    return max(1, int(getattr(generator, "parallel_requests", 1)))


@runtime_checkable
class ScoringGenerator(Generator, Protocol):
    """A Generator that can also teacher-force: the log-probability of each token of a given reply
    (its ``mean_token_probability`` is that text's q_txt, GTR+ Eq. 8). Optional: ``llama-cpp`` and the
    grounded captioner over it implement it."""

    def score(self, requests: list[GenerationRequest], texts: list[str]) -> list[GenerationResult]: ...


def score_texts(generator: Generator, requests: list[GenerationRequest], texts: list[str]) -> list[GenerationResult]:
    """``generator.score(requests, texts)``; NotImplementedError naming the backend when it cannot."""
    score = getattr(generator, "score", None)
    if score is None:
        raise NotImplementedError(f"teacher forcing: generator {type(generator).__name__} "
                                  f"({getattr(generator, 'model_id', '?')}) cannot score a given text")
    return score(requests, texts)

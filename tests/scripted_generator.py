"""A scripted Generator for unit tests of stages that call generators (never used by flows)."""

from __future__ import annotations

import math
from collections.abc import Callable

from models.backends.interfaces import GenerationRequest, GenerationResult, TokenLogprob


class ScriptedGenerator:
    """Answers each request with ``script(request)``: a text, or an ``Exception`` instance whose
    message becomes the result's error. Token probabilities are 0.5 per word (q_txt = 0.5)."""

    def __init__(self, script: Callable[[GenerationRequest], str | Exception], model_id: str = "scripted") -> None:
        self.script, self.model_id = script, model_id
        self.calls: list[GenerationRequest] = []

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for request in requests:
            self.calls.append(request)
            answer = self.script(request)
            if isinstance(answer, Exception):
                out.append(GenerationResult(request.request_id, "", [], self.model_id, None, str(answer)))
                continue
            tokens = [TokenLogprob(w + " ", math.log(0.5)) for w in answer.split()]
            out.append(GenerationResult(request.request_id, answer, tokens, self.model_id, "stop"))
        return out

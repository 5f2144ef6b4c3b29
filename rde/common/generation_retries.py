"""Bounded retries with exponential backoff for generator calls, then a recorded failure.

Backends never raise for one bad request; they return a result with ``error`` set. Transient
errors (timeouts, server errors, a backend exception) are asked again; errors that asking again
cannot fix (refusals, unsupported inputs, ungrounded captions) are returned at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from models.backends.interfaces import GenerationRequest, GenerationResult, Generator

PERMANENT_PREFIXES = ("refused", "unsupported", "ungrounded")


def error_reason(error: str | None) -> str:
    """A reason code for a failed generation result (its error text stays in the detail)."""
    text = (error or "").lower()
    for prefix, code in (("ungrounded", "ungrounded"), ("refused", "refused"), ("unsupported", "unsupported"),
                         ("timeout", "timeout"), ("malformed", "malformed_output")):
        if text.startswith(prefix):
            return code
    return "generation_failed"


def is_transient(result: GenerationResult) -> bool:
    return not result.ok and not (result.error or "").lower().startswith(PERMANENT_PREFIXES)


def generate_with_retries(generator: Generator, requests: list[GenerationRequest], max_attempts: int = 3,
                          backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep
                          ) -> list[GenerationResult]:
    """Results in request order; transient failures re-sent up to ``max_attempts`` calls in all,
    waiting ``backoff_s · 2^(attempt-1)`` between rounds. ``attempts`` on each result counts calls."""
    results: dict[str, GenerationResult] = {}
    pending = list(requests)
    for attempt in range(1, max_attempts + 1):
        if not pending:
            break
        if attempt > 1:
            sleep(backoff_s * 2 ** (attempt - 2))
        answered = generator.generate(pending)
        if len(answered) != len(pending):
            raise RuntimeError(f"generator {generator.model_id} returned {len(answered)} results "
                               f"for {len(pending)} requests")
        retry = []
        for request, result in zip(pending, answered, strict=True):
            result.attempts = attempt
            results[request.request_id] = result
            if is_transient(result) and attempt < max_attempts:
                retry.append(request)
        pending = retry
    return [results[r.request_id] for r in requests]

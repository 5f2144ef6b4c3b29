"""The OpenAI-compatible HTTP generator against a real local server: retries, timeouts, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from openai_stub import StubServer

from models.backends.generators import OpenAIHttpGenerator
from models.backends.interfaces import ChatMessage, GenerationRequest
from models.backends.model_errors import ModelLoadError
from models.specs import ModelSpec


def _gen(server: StubServer, **options) -> OpenAIHttpGenerator:
    opts = {"base_url": server.base_url, "timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.05, **options}
    return OpenAIHttpGenerator(ModelSpec(backend="openai-http", model_id="stub-model", options=opts))


def _req(text: str, rid: str | None = None, images=None) -> GenerationRequest:
    return GenerationRequest(rid or text, [ChatMessage("user", text, images or [])], max_tokens=8)


def test_ok_response_with_logprobs_and_q_txt() -> None:
    with StubServer() as server:
        [res] = _gen(server).generate([_req("ok")])
    assert res.ok and res.text == "A person." and res.attempts == 1
    assert [t.token for t in res.tokens] == ["A", " person", "."]
    # q_txt = mean of token probabilities (0.5, 0.25, 1.0), not their product
    assert res.mean_token_probability == pytest.approx((0.5 + 0.25 + 1.0) / 3)
    assert math.prod(math.exp(t.logprob) for t in res.tokens) == pytest.approx(0.125)


def test_transient_503_is_retried_then_succeeds() -> None:
    with StubServer() as server:
        [res] = _gen(server).generate([_req("flaky:a")])
        assert server.state.calls["flaky:a"] == 3
    assert res.ok and res.attempts == 3


def test_timeouts_give_up_after_bounded_retries() -> None:
    """The stub answers "slow" 2 s after each request: a result without that answer is the client
    giving up at its timeout_s (0.5 s), not a wait for it, so no wall-clock bound is needed (one,
    on a loaded machine, would only measure the load)."""
    with StubServer() as server:
        [res] = _gen(server, max_retries=1).generate([_req("slow")])
    assert not res.ok and res.text == "" and res.attempts == 2
    assert res.error.startswith("timeout after 0.5s") and "gave up after 2 attempts" in res.error


@pytest.mark.parametrize(("prompt", "expected", "calls"), [
    ("malformed", "malformed response: body is not JSON (gave up after 3 attempts)", 3),
    ("noshape", "malformed response: KeyError", 1),
    ("refuse", "refused: I can't help with that.", 1),
    ("badrequest", "HTTP 400", 1),
    ("always500", "HTTP 500", 3),
])
def test_failures_become_error_results(prompt: str, expected: str, calls: int) -> None:
    with StubServer() as server:
        [res] = _gen(server).generate([_req(prompt)])
        assert server.state.calls[prompt] == calls
    assert not res.ok and res.text == "" and res.error.startswith(expected)


def test_batch_keeps_order_bounds_concurrency_and_isolates_failures() -> None:
    prompts = [f"ok{i}" for i in range(10)] + ["badrequest"]
    with StubServer() as server:
        results = _gen(server, max_concurrency=3, timeout_s=10.0).generate([_req(p) for p in prompts])
        assert 1 < server.state.max_in_flight <= 3
    assert [r.request_id for r in results] == prompts
    assert all(r.ok for r in results[:10]) and not results[10].ok


def test_api_key_comes_from_the_environment_and_images_travel_as_data_urls(monkeypatch) -> None:
    monkeypatch.setenv("STUB_KEY", "secret-123")
    image = np.zeros((20, 10, 3), np.uint8)
    with StubServer() as server:
        _gen(server, api_key_env="STUB_KEY").generate([_req("ok", images=[image])])
        assert server.state.auth_headers == ["Bearer secret-123"]
        part = server.state.bodies[0]["messages"][0]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/jpeg;base64,")


def test_missing_base_url_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match=r"needs options\.base_url"):
        OpenAIHttpGenerator(ModelSpec(backend="openai-http", model_id="x"))

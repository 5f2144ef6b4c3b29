"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions schema (with logprobs).

The last user message picks the behaviour: ``ok``, ``flaky:<key>`` (two 503s, then ok),
``slow`` (answers after 2 s), ``malformed`` (body not JSON), ``noshape`` (JSON without choices),
``refuse`` (message.refusal), ``badrequest`` (400), ``always500``. A ``script`` callable
(text → status, body, delay) replaces these rules (fault-injection tests).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS = [("A", math.log(0.5)), (" person", math.log(0.25)), (".", math.log(1.0))]


class StubState:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.auth_headers: list[str | None] = []
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.script: Callable[[str], tuple[int, bytes, float]] | None = None


def _completion(text: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "stub",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
                         "logprobs": {"content": [{"token": t, "logprob": lp, "top_logprobs": []}
                                                  for t, lp in TOKENS]}}]}


def make_handler(state: StubState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def _leave(self) -> None:
            """This request stops counting as in flight: before its response is written, since
            the client may send its next request as soon as it has read this one's."""
            if getattr(self, "_in_flight", False):
                self._in_flight = False
                with state.lock:
                    state.in_flight -= 1

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self._leave()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            content = body["messages"][-1]["content"]
            text = content if isinstance(content, str) else content[-1]["text"]
            with state.lock:
                state.calls[text] += 1
                calls = state.calls[text]
                state.in_flight += 1
                self._in_flight = True
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                state.auth_headers.append(self.headers.get("Authorization"))
                state.bodies.append(body)
            try:
                time.sleep(0.05)  # long enough for concurrent requests to overlap
                if state.script is not None:
                    with state.lock:
                        status, payload, delay = state.script(text)
                    time.sleep(delay)
                    self._send(status, payload)
                elif text == "slow":
                    time.sleep(2.0)
                    self._send(200, json.dumps(_completion("late")).encode())
                elif text.startswith("flaky") and calls <= 2:
                    self._send(503, b'{"error": "overloaded"}')
                elif text == "malformed":
                    self._send(200, b"{not json")
                elif text == "noshape":
                    self._send(200, b'{"result": "no choices here"}')
                elif text == "refuse":
                    payload = _completion("")
                    payload["choices"][0]["message"] = {"role": "assistant", "content": None,
                                                        "refusal": "I can't help with that."}
                    self._send(200, json.dumps(payload).encode())
                elif text == "badrequest":
                    self._send(400, b'{"error": "bad request"}')
                elif text == "always500":
                    self._send(500, b'{"error": "boom"}')
                else:
                    self._send(200, json.dumps(_completion("A person.")).encode())
            finally:
                self._leave()

    return Handler


class StubServer:
    """Context manager: ``with StubServer() as s: s.base_url``."""

    def __init__(self, script: Callable[[str], tuple[int, bytes, float]] | None = None) -> None:
        self.script = script

    def __enter__(self) -> StubServer:
        self.state = StubState()
        self.state.script = self.script
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

"""A server started as a subprocess for a test module (vLLM's, Label Studio's): its output to a log,
the test waiting until a URL answers, the server stopped at the end."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


@contextlib.contextmanager
def serving(name: str, command: list[str], env: dict[str, str], log: Path, ready_url: str,
            timeout_s: float) -> Iterator[float]:
    """Start ``command`` in a session of its own and wait until ``ready_url`` answers with a success;
    yields the seconds that took (and prints them). A server that exits or does not answer in time
    fails the test with its log's tail."""
    started = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while time.monotonic() - started < timeout_s:
            assert server.poll() is None, f"{name} exited: {log.read_text()[-3000:]}"
            try:
                if httpx.get(ready_url, timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError(f"{name} not up after {timeout_s} s: {log.read_text()[-3000:]}")
        took = time.monotonic() - started
        print(f"{name} answered {took:.1f} s after its start")
        yield took
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()

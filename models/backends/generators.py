"""(M)LLM generators with per-token log-probabilities, behind ``Generator``, and the OpenAI chat format.

* ``OpenAIHttpGenerator``: any OpenAI-compatible chat-completions server (``vllm serve``...), with
  bounded concurrency, timeouts and retries with exponential backoff.
* ``VllmGenerator``: vLLM's in-process offline engine (``vllm.LLM``), batched, with logprobs.
* ``TransformersVlmGenerator``: Qwen2-VL / InternVL-style ``AutoModelForImageTextToText``, or a
  text-only ``AutoModelForCausalLM`` (a Qwen3 text LLM).
* The OpenAI chat format the backends share (``openai_messages``, ``parse_chat_completion``,
  ``failed_result``).

The llama.cpp generator (``LlamaCppGenerator``, the bundled SmolLM2 offline) and its GGUF tokenizer
for teacher forcing are in ``models.backends.llama_cpp_generator``: a backend of its own, with its
contexts and its GGUF reading.

A failing request never raises: it returns a ``GenerationResult`` with ``error`` set, so the
stage can store a rejected row with the reason.
"""

from __future__ import annotations

import base64
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import cv2
import numpy as np

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, TokenLogprob
from models.backends.model_errors import ModelLoadError, hub_hint
from models.specs import ModelSpec


def failed_result(request: GenerationRequest, model_id: str, error: str, attempts: int = 1) -> GenerationResult:
    """A request's failed result (``error`` set): a backend returns it instead of raising."""
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
            return failed_result(request, model_id, f"refused: {str(refusal)[:200]}", attempts)
        finish = choice.get("finish_reason")
        if finish == "content_filter":
            return failed_result(request, model_id, "refused: content_filter", attempts)
        text = message.get("content")
        if not isinstance(text, str):
            return failed_result(request, model_id, "malformed response: message.content is not text", attempts)
        content = ((choice.get("logprobs") or {}).get("content")) or []
        tokens = [TokenLogprob(str(t["token"]), float(t["logprob"])) for t in content]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return failed_result(request, model_id, f"malformed response: {type(exc).__name__}: {exc}", attempts)
    return GenerationResult(request.request_id, text, tokens, model_id, finish, None, attempts)


def put_field(body: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``body[a][b]...`` for a dotted field name (vLLM nests structured-output options)."""
    *parents, last = dotted.split(".")
    for name in parents:
        body = body.setdefault(name, {})
    body[last] = value


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
                    return failed_result(request, self.model_id, f"HTTP {response.status_code}: {response.text[:200]}",
                                   attempt)
            if attempt <= self.max_retries:
                time.sleep(self.backoff * 2 ** (attempt - 1) * (1 + random.random() * 0.25))
        return failed_result(request, self.model_id, f"{last_error} (gave up after {self.max_retries + 1} attempts)",
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
                return [failed_result(requests[0], self.model_id, f"generation failed: {type(exc).__name__}: {exc}")]
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
                results.extend(failed_result(r, self.model_id, f"generation failed: {type(exc).__name__}: {exc}")
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

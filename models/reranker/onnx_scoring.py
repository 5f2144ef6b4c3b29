"""ONNX Runtime serving path of the joint reranker: ``JointReranker.fast_scores`` (the
arithmetic of ``score_fast``) traced once into an ONNX graph and run by ONNX Runtime's CPU provider.

Same operations, same FP32, so the same scores up to float rounding (tested against the reference
forward at atol 1e-4, ``tests/test_vedje_model.py``). What it gains (``benchmarks/vedje_latency.py``,
2 threads, M = 4, N_c = 20: scoring ≈ 1.1–1.3× faster than ``score_fast`` in PyTorch): not the
matrix products, which ≈ 3/4 of the scoring are and which both run near the two cores' FP32 peak,
but everything around them (no per-operator dispatch, fused bias + GELU, an arena allocator instead
of fresh buffers per operator); it also degraded far less than PyTorch's OpenMP threads when other
processes loaded the shared CPU.

The graph takes the text's word embeddings (the vocabulary table stays in PyTorch), the text
mask, the pair→query rows, the caches and ρ, with dynamic query / text / pair / cache lengths; the
attention mask is always applied (an all-ones mask changes no score). A graph is built on first use
and rebuilt when the weights change (a parameter replaced or written in place) or the thread
count does; export + session take a few seconds, a one-off cost per loaded model.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from models.reranker.joint_encoder import JointReranker, TextBatch

OPSET = 17  # LayerNormalization as one op
log = logging.getLogger(__name__)


def runtime_available() -> bool:
    """onnxruntime to run the graph and onnx for torch's exporter to write it."""
    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def onnx_scoring_supported(reranker: JointReranker) -> bool:
    """Whether ``score_onnx`` can run: ``score_fast``'s encoder on the CPU, onnx and onnxruntime installed."""
    return reranker.device.type == "cpu" and reranker.fast_scoring_supported() and runtime_available()


def score_onnx(reranker: JointReranker, text: TextBatch, rows: torch.Tensor, cache: torch.Tensor,
               rho: torch.Tensor) -> torch.Tensor:
    """``JointReranker.score_fast``'s graph run by ONNX Runtime on the CPU: exported once per weights
    and thread count, then each call runs it. Equal to ``score`` up to float rounding; eval mode only
    (no dropout). Needs ``onnx_scoring_supported``; should the export fail (a future exporter, say),
    it logs why and scores with ``score_fast``. A function here, not a method of the reranker, so
    the encoder module does not import this one (imports run one way)."""
    reranker._check_positions(cache.shape[1])  # the graph checked them once, at export
    words = reranker.bert.embeddings.word_embeddings(text.ids)
    scorer = scorer_for(reranker)
    if scorer is None:  # the export failed for these weights (logged): the same function in PyTorch
        return reranker.fast_scores(words, text.mask, rows.to(text.ids.device), cache, rho)
    return scorer(words, text.mask, rows, cache, rho)


class _Graph(nn.Module):
    """What is exported: ``fast_scores`` (or, for comparison, the reference forward ``score``)."""

    def __init__(self, reranker: JointReranker, full_forward: bool = False) -> None:
        super().__init__()
        self.reranker, self.full_forward = reranker, full_forward

    def forward(self, words: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor,
                rho: torch.Tensor) -> torch.Tensor:
        if self.full_forward:
            return self.reranker.score_embedded(words, mask, rows, cache, rho)
        return self.reranker.fast_scores(words, mask, rows, cache, rho, always_mask=True)


def _weights_key(reranker: JointReranker, threads: int) -> tuple:
    """Changes when a parameter is replaced (``.to``, a new tensor) or written in place
    (``load_state_dict``, an optimiser step), or the thread count changes."""
    return threads, tuple((id(p), p._version) for p in reranker.parameters())


class OnnxScorer:
    """One exported graph and its ONNX Runtime session (CPU, ``threads`` intra-op threads).
    ``config``: session config entries over the defaults; ``full_forward``: export the reference forward
    instead (a benchmark comparison); ``profile_prefix``: ONNX Runtime's profiler on."""

    def __init__(self, reranker: JointReranker, threads: int, config: dict[str, str] | None = None,
                 full_forward: bool = False, profile_prefix: str | None = None) -> None:
        import onnxruntime as ort

        d = reranker.d
        g = torch.Generator().manual_seed(0)
        example = (torch.randn(1, 3, d, generator=g), torch.ones(1, 3, dtype=torch.long),
                   torch.zeros(2, dtype=torch.long), torch.randn(2, 2, d, generator=g), torch.rand(2, generator=g))
        axes = {"words": {0: "queries", 1: "length"}, "mask": {0: "queries", 1: "length"}, "rows": {0: "pairs"},
                "cache": {0: "pairs", 1: "tokens"}, "rho": {0: "pairs"}}
        buf = io.BytesIO()
        was = reranker.training
        reranker.eval()
        try:
            with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notes
                torch.onnx.export(_Graph(reranker, full_forward), example, buf, dynamo=False, opset_version=OPSET,
                                  input_names=list(axes), output_names=["scores"], dynamic_axes=axes)
        finally:
            reranker.train(was)
        self.graph = buf.getvalue()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        # idle workers sleep instead of spinning: the 2-core CPU is shared with stage 1's PyTorch
        # threads (and, on a serving box, other processes), which spinning workers slow down
        for name, value in ({"session.intra_op.allow_spinning": "0"} | (config or {})).items():
            opts.add_session_config_entry(name, value)
        if profile_prefix is not None:
            opts.enable_profiling, opts.profile_file_prefix = True, profile_prefix
        self.session = ort.InferenceSession(self.graph, opts, providers=["CPUExecutionProvider"])

    def __call__(self, words: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor,
                 rho: torch.Tensor) -> torch.Tensor:
        def arr(t: torch.Tensor, dtype: type) -> np.ndarray:
            return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=dtype)

        feed = {"words": arr(words, np.float32), "mask": arr(mask, np.int64), "rows": arr(rows, np.int64),
                "cache": arr(cache, np.float32), "rho": arr(rho.reshape(-1), np.float32)}
        return torch.from_numpy(self.session.run(None, feed)[0])


class ScorerSlot:
    """Where a reranker keeps its scorer, outside the module's state: a copy or pickle of the
    reranker gets an empty slot (the session is rebuilt on first use)."""

    def __init__(self) -> None:
        self.scorer: OnnxScorer | None = None
        self.key: tuple | None = None

    def __deepcopy__(self, memo: dict) -> ScorerSlot:
        return ScorerSlot()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def scorer_for(reranker: JointReranker) -> OnnxScorer | None:
    """The reranker's scorer for its current weights and torch's thread count (built if needed);
    None when the export or the session failed for them (logged once; the caller falls back)."""
    slot = reranker.__dict__.get("_onnx_slot")
    if slot is None:
        slot = reranker.__dict__["_onnx_slot"] = ScorerSlot()
    threads = torch.get_num_threads()
    key = _weights_key(reranker, threads)
    if slot.key != key:
        try:
            slot.scorer = OnnxScorer(reranker, threads)
        except Exception as exc:  # an exporter or runtime this code does not know: serve from PyTorch
            log.warning("ONNX Runtime scoring unavailable (%s: %s); scoring with score_fast in PyTorch",
                        type(exc).__name__, exc)
            slot.scorer = None
        slot.key = key
    return slot.scorer

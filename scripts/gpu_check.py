"""Throughput check for one GPU: the three model families of a LargeFine-Person style build.

What it measures (each model is built from a ``transformers`` config with RANDOM weights, because no
weights can be fetched on the check machine; the figures are speeds of real-size architectures, not of
trained checkpoints, and nothing about output quality):

1. DINOv2-L/14 image embedder (``Dinov2Model``; hidden 1024, 24 layers, 16 heads, MLP 4096, patch 14) on
   224x224 images: images/s at batch 256.
2. CLIP ViT-L/14 expert (``CLIPModel``; vision 1024/24/16/4096, patch 14, image 224; text 768/12/12/3072,
   77 positions): images/s (``get_image_features``) and texts/s (``get_text_features``, 77 tokens) at
   batch 256.
3. Qwen2-VL-2B generator (``Qwen2VLForConditionalGeneration``, 2B sizes incl. M-RoPE ``mrope_section``
   [16, 24, 24]) with one 224x224 image per request, built by hand (no processor offline): greedy
   ``generate`` with ``min_new_tokens = max_new_tokens = --new-tokens`` (128), so every request
   generates exactly that many tokens. Generated tokens/s and requests/s at batch 1, 16 and 64, plus a
   prefill-only run (one new token) per batch that splits the time into prefill and decode steps.

All runs are in ``torch.inference_mode`` at ``--dtype`` (bf16 on cuda), after one warm-up iteration (for the
generator a short 4-token generate at the same batch), timed with ``time.perf_counter`` between
``torch.cuda.synchronize`` calls. An out-of-memory error at a batch is
recorded (``status: oom``) instead of ending the run; ``--time-budget-s`` stops adding measurements
(e.g. skips batch 64) once the next one would not fit.

4. The whole production path on tiny models (``--path``, on by default): ``profiles/tiny-production.yaml``
   (the production backends, each model a tiny random-weight one built from config) over a 12-crop slice
   of the demo pool, running ``--path-flows`` (build-secmm and build-largefine) on ``--device`` with the
   profile's ``batch_size: auto`` measured there, and in-process vLLM for the generators where the
   ``vllm`` package is installed (else ``transformers-vlm``). Per flow: seconds, inputs, accepted,
   rejects by reason, balanced, or the error it stopped with. It needs the project's environment
   (``make setup``); where that is missing the check says so and goes on.

It then projects a 1.2M-image three-tier build (per image: one DINOv2 embedding, one CLIP image
embedding, base / intermediate / advanced captions with the request and token counts given by the
``--base-*``, ``--inter-*`` and ``--adv-*`` options) onto 1, 8 and 32 such GPUs and prints every assumption.

Run it on the GPU machine (torch and transformers installed, no vLLM, no network needed):

    python scripts/gpu_check.py --json gpu-check.json

On a CPU, ``--tiny`` runs the same code path with tiny configs and small batches in about a minute:

    python scripts/gpu_check.py --tiny --device cpu --json /tmp/gpu-check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    CLIPConfig,
    CLIPModel,
    Dinov2Config,
    Dinov2Model,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_COUNTS = (1, 8, 32)
TINY_ALLOWED_TOKENS = 1  # --tiny: only id 0 is not an EOS id (see eos_ids)


# -- configs -----------------------------------------------------------------------------------------------


def dinov2_config(tiny: bool) -> Dinov2Config:
    """DINOv2-L/14 (or a 2-layer, hidden-64 stand-in) at a native 224x224 input: no position interpolation."""
    if tiny:
        return Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4,
                            patch_size=14, image_size=224)
    return Dinov2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, mlp_ratio=4,
                        patch_size=14, image_size=224, layerscale_value=1.0)


def clip_config(tiny: bool) -> CLIPConfig:
    """CLIP ViT-L/14 at 224 with the 77-token text tower (projection 768), or a tiny stand-in."""
    if tiny:
        vision = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                  "patch_size": 14, "image_size": 224, "projection_dim": 32}
        text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                "max_position_embeddings": 77, "vocab_size": 1000, "projection_dim": 32,
                "bos_token_id": 998, "eos_token_id": 999}
        return CLIPConfig(vision_config=vision, text_config=text, projection_dim=32)
    vision = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
              "patch_size": 14, "image_size": 224, "projection_dim": 768}
    text = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
            "max_position_embeddings": 77, "projection_dim": 768}
    return CLIPConfig(vision_config=vision, text_config=text, projection_dim=768)


def qwen2vl_config(tiny: bool) -> Qwen2VLConfig:
    """Qwen2-VL-2B-Instruct sizes (its config.json, in transformers-5 field names), or a tiny stand-in.

    transformers 5 spells the 2B config's ``rope_scaling: {type: mrope, mrope_section: [16, 24, 24]}`` as
    ``rope_parameters`` with ``rope_type: default`` (the config class maps "mrope" to "default" itself).
    The tiny stand-in puts its special ids at the top of a 512-token vocabulary and keeps the mrope
    sections summing to head_dim / 2 (16 / 2 = 8).
    """
    if tiny:
        text = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6, "bos_token_id": 505, "eos_token_id": 504,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}}
        vision = {"depth": 2, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 4, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
        return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=500, video_token_id=501,
                             vision_start_token_id=502, vision_end_token_id=503, tie_word_embeddings=True)
    text = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
            "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 28,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]}}
    vision = {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "hidden_act": "quick_gelu"}
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                         vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=True)


# -- timing helpers ------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget for measurements, counted from the start of the script."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, estimate_s: float) -> bool:
        return self.elapsed() + estimate_s <= self.seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, iters: int = 1) -> tuple[float, Any]:
    """Seconds for ``iters`` calls of fn (synchronised before and after) and the last result."""
    sync(device)
    start = time.perf_counter()
    result = None
    for _ in range(iters):
        result = fn()
    sync(device)
    return time.perf_counter() - start, result


def build(model_cls: type, config: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random-weight model built straight on the device (fp32 init), then cast to dtype, in eval mode."""
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype=dtype).eval()


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# -- image and text embedders --------------------------------------------------------------------------------


def throughput(fn: Callable[[], Any], device: torch.device, batch: int, iters: int, unit: str) -> dict[str, Any]:
    """One warm-up call, then ``iters`` timed calls; items/s = batch * iters / seconds. OOM is recorded."""
    reset_peak(device)
    try:
        with torch.inference_mode():
            fn()
            seconds, _ = timed(fn, device, iters)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        if not is_oom(exc):
            raise
        error = str(exc).splitlines()[0]
    else:
        error = None
    if error is not None:
        release(device)  # outside the except block: the traceback no longer pins the activations
        return {"status": "oom", "batch": batch, "error": error}
    return {"status": "ok", "batch": batch, "iters": iters, "seconds": round(seconds, 4),
            f"{unit}_per_s": batch * iters / seconds, "peak_memory_gib": peak_memory_gib(device)}


def random_images(batch: int, size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, device=device, dtype=dtype)


def check_dinov2(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    config = dinov2_config(args.tiny)
    model = build(Dinov2Model, config, device, dtype)
    pixels = random_images(args.embed_batch, config.image_size, device, dtype)
    result = throughput(lambda: model(pixel_values=pixels).pooler_output, device, args.embed_batch, args.iters,
                        "images")
    result["params"] = n_params(model)
    return result  # the model goes with this frame; run() releases the cached memory


def random_texts(batch: int, length: int, vocab: int, eos: int, device: torch.device) -> torch.Tensor:
    """Random ids of full length 77 with the EOS id last (CLIP pools at the first EOS position)."""
    ids = torch.randint(0, min(vocab, eos), (batch, length), device=device)
    ids[:, -1] = eos
    return ids


def check_clip(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    config = clip_config(args.tiny)
    model = build(CLIPModel, config, device, dtype)
    pixels = random_images(args.embed_batch, config.vision_config.image_size, device, dtype)
    text_cfg = config.text_config
    ids = random_texts(args.embed_batch, text_cfg.max_position_embeddings, text_cfg.vocab_size,
                       text_cfg.eos_token_id, device)
    mask = torch.ones_like(ids)
    image = throughput(lambda: model.get_image_features(pixel_values=pixels).pooler_output, device,
                       args.embed_batch, args.iters, "images")
    text = throughput(lambda: model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output, device,
                      args.embed_batch, args.iters, "texts")
    text["tokens_per_text"] = text_cfg.max_position_embeddings
    return {"image": image, "text": text, "params": n_params(model)}


# -- generator -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenInputs:
    kwargs: dict[str, torch.Tensor]
    prompt_len: int
    image_tokens: int


def text_id_limit(config: Qwen2VLConfig) -> int:
    """Ids below every special id (vision markers, image/video, bos/eos) count as ordinary text."""
    text = config.text_config
    specials = [config.image_token_id, config.video_token_id, config.vision_start_token_id,
                config.vision_end_token_id, text.bos_token_id, text.eos_token_id]
    return min(s for s in specials if s is not None)


def generator_inputs(config: Qwen2VLConfig, batch: int, prompt_text_tokens: int, image_size: int,
                     device: torch.device, dtype: torch.dtype, seed: int = 0) -> GenInputs:
    """What the Qwen2-VL processor would produce for ``batch`` requests of one image + text each.

    One 224x224 image is a grid t=1, h=w=224/14=16: 256 patches of 3*2*14*14 = 1176 values, and 256/4 = 64
    image tokens in the prompt after the 2x2 merge. Per request: text ids, vision_start, 64 image tokens,
    vision_end, more text ids. transformers 5 also needs ``mm_token_type_ids`` (1 on image tokens) to compute
    the 3D M-RoPE positions once ``image_grid_thw`` is given.
    """
    vis = config.vision_config
    grid_hw = image_size // vis.patch_size
    patches = 1 * grid_hw * grid_hw
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
    image_tokens = patches // vis.spatial_merge_size**2
    pre = prompt_text_tokens // 4
    post = prompt_text_tokens - pre
    gen = torch.Generator().manual_seed(seed)
    limit = text_id_limit(config)
    rows = []
    for _ in range(batch):
        row = torch.cat([torch.randint(0, limit, (pre,), generator=gen),
                         torch.tensor([config.vision_start_token_id] + [config.image_token_id] * image_tokens
                                      + [config.vision_end_token_id]),
                         torch.randint(0, limit, (post,), generator=gen)])
        rows.append(row)
    input_ids = torch.stack(rows).to(device)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == config.image_token_id).to(torch.int32),
        "pixel_values": torch.randn(batch * patches, patch_dim, generator=gen).to(device=device, dtype=dtype),
        "image_grid_thw": torch.tensor([[1, grid_hw, grid_hw]] * batch, device=device),
    }
    return GenInputs(kwargs=kwargs, prompt_len=input_ids.shape[1], image_tokens=image_tokens)


def eos_ids(config: Qwen2VLConfig, tiny: bool) -> list[int]:
    """Qwen2-VL stops on <|im_end|> and <|endoftext|>. --tiny makes nearly every id an EOS id, so the run
    reaches --new-tokens only if min_new_tokens really suppresses EOS (a random model would else stop at once)."""
    if tiny:
        return list(range(TINY_ALLOWED_TOKENS, config.text_config.vocab_size))
    return [config.text_config.eos_token_id, config.text_config.bos_token_id]


def generated_lengths(sequences: torch.Tensor, prompt_len: int, eos: list[int]) -> list[int]:
    """Tokens each request generated: up to and including its first EOS id, else all of them."""
    new = sequences[:, prompt_len:]
    stops = torch.isin(new, torch.tensor(eos, device=new.device))
    lengths = []
    for row in stops:
        hit = torch.nonzero(row)
        lengths.append(int(hit[0, 0]) + 1 if len(hit) else new.shape[1])
    return lengths


def generate_fn(model: torch.nn.Module, inputs: GenInputs, new_tokens: int, eos: list[int],
                pad: int) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        return model.generate(**inputs.kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad, use_cache=True)
    return run


def measure_batch(model: torch.nn.Module, config: Qwen2VLConfig, args: argparse.Namespace, batch: int,
                  device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Warm-up (a short generate), prefill-only run (1 new token), then the timed full run."""
    eos = eos_ids(config, args.tiny)
    pad = config.text_config.bos_token_id
    inputs = generator_inputs(config, batch, args.prompt_tokens, args.image_size, device, dtype, seed=batch)
    reset_peak(device)
    with torch.inference_mode():
        timed(generate_fn(model, inputs, min(args.new_tokens, 4), eos, pad), device)
        prefill_s, _ = timed(generate_fn(model, inputs, 1, eos, pad), device)
        seconds, out = timed(generate_fn(model, inputs, args.new_tokens, eos, pad), device)
    lengths = generated_lengths(out, inputs.prompt_len, eos)
    step_s = (seconds - prefill_s) / (args.new_tokens - 1) if args.new_tokens > 1 else seconds
    step_s = step_s if step_s > 0 else seconds / args.new_tokens  # timing noise on tiny runs
    return {"status": "ok", "batch": batch, "seconds": round(seconds, 4), "prefill_s": round(prefill_s, 4),
            "decode_step_s": step_s, "tokens_per_s": sum(lengths) / seconds,
            "requests_per_s": batch / seconds, "decode_tokens_per_s": batch / step_s,
            "prompt_tokens": inputs.prompt_len, "image_tokens_per_request": inputs.image_tokens,
            "generated_lengths": lengths, "output_new_tokens": out.shape[1] - inputs.prompt_len,
            "peak_memory_gib": peak_memory_gib(device)}


def next_estimate(done: list[dict[str, Any]], batch: int) -> float:
    """Rough seconds for the next batch: the last one's warm-up + prefill + run, scaled by sqrt(batch ratio)
    (decode is mostly memory-bound, so time grows slower than the batch)."""
    if not done:
        return 0.0
    last = done[-1]
    spent = last["seconds"] + 2 * last["prefill_s"]
    return spent * math.sqrt(batch / last["batch"])


def check_generator(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                    budget: Budget) -> dict[str, Any]:
    config = qwen2vl_config(args.tiny)
    result: dict[str, Any] = {"new_tokens": args.new_tokens, "prompt_text_tokens": args.prompt_tokens,
                              "image_size": args.image_size, "batches": {}}
    if not budget.allows(0.0):
        result["batches"] = {str(b): {"status": "skipped_budget", "batch": b} for b in args.batches}
        return result
    model = build(Qwen2VLForConditionalGeneration, config, device, dtype)
    result["params"] = n_params(model)
    result["attn_implementation"] = config._attn_implementation
    done: list[dict[str, Any]] = []
    oom = False
    for batch in args.batches:
        if oom:
            result["batches"][str(batch)] = {"status": "skipped_after_oom", "batch": batch}
            continue
        estimate = next_estimate(done, batch)
        if not budget.allows(estimate):
            result["batches"][str(batch)] = {"status": "skipped_budget", "batch": batch,
                                             "estimate_s": round(estimate, 1)}
            continue
        try:
            entry = measure_batch(model, config, args, batch, device, dtype)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            oom = True
            entry = {"status": "oom", "batch": batch, "error": str(exc).splitlines()[0]}
        else:
            done.append(entry)
        if oom:
            release(device)  # outside the except block, so the traceback's tensors can go
        result["batches"][str(batch)] = entry
        print(f"  generator batch {batch}: {entry['status']}", flush=True)
    return result


# -- projection ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tier:
    name: str
    tokens_per_image: int  # generated tokens, all requests of the tier together
    requests_per_image: int
    images_per_request: int

    def seconds_per_image(self, prefill_s: float, step_s: float, batch: int) -> float:
        """Per image on one GPU at ``batch``: each request's prefill (scaled by its images; it also yields the
        first token) plus one decode step per further token, both shared by the batch."""
        prefill = self.requests_per_image * self.images_per_request * prefill_s / batch
        decode = max(self.tokens_per_image - self.requests_per_image, 0) * step_s / batch
        return prefill + decode


def tiers(args: argparse.Namespace) -> list[Tier]:
    return [Tier("base", args.base_tokens, args.base_requests, args.base_images),
            Tier("inter", args.inter_tokens, args.inter_requests, args.inter_images),
            Tier("adv", args.adv_tokens, args.adv_requests, args.adv_images)]


def projection_batch(gen: dict[str, Any], wanted: int | None) -> dict[str, Any] | None:
    ok = [e for e in gen["batches"].values() if e["status"] == "ok"]
    if wanted is not None:
        ok = [e for e in ok if e["batch"] == wanted]
    return max(ok, key=lambda e: e["batch"]) if ok else None


def rate(entry: dict[str, Any], key: str) -> float | None:
    return entry.get(key) if entry.get("status") == "ok" else None


def assumptions(args: argparse.Namespace, gen_entry: dict[str, Any] | None, device_name: str) -> list[str]:
    batch = gen_entry["batch"] if gen_entry else "n/a"
    tier_text = "; ".join(f"{t.name}: {t.requests_per_image} request(s)/image, {t.tokens_per_image} generated "
                          f"tokens/image, {t.images_per_request} image(s)/request" for t in tiers(args))
    return [
        f"{args.images:,} images; per image one DINOv2 embedding, one CLIP image embedding, "
        f"{args.clip_texts_per_image} CLIP text embedding(s) and three caption tiers",
        f"caption tiers (defaults follow rde/largefine/tiered_captions.py: base and inter = Q&A request + "
        f"summary request, inter with target + hard-negative images, adv = one ~60-token caption): {tier_text}",
        f"generation at batch {batch} (the largest batch measured here), every batch full, all requests "
        f"of a batch the same length; per request: prefill time measured with one {args.image_size}x"
        f"{args.image_size} image and {args.prompt_tokens} prompt text tokens, scaled linearly by images per "
        f"request (an upper bound: text prefill does not double), then decode steps as measured at that batch",
        "embedders at the measured batch sizes; the three stages run one after the other on the same GPUs "
        "(hours add up), no overlap",
        "perfect linear scaling across GPUs (N GPUs = 1/N of the hours), no data-loading, decoding, I/O, "
        "network or scheduling bound, no retries or rejected captions re-asked",
        "random-weight speed equals trained-weight speed (same shapes, same kernels; greedy decoding with "
        "a fixed number of new tokens, so output content does not change the work)",
        f"HF transformers generate ({transformers.__version__}, static batches, no paged KV cache, no "
        "continuous batching), not vLLM: a serving engine would be markedly faster, so caption hours are "
        "pessimistic",
        f"measured on: {device_name}, dtype {args.dtype}",
    ]


def project(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """Hours for each part of the build and in total on N = 1, 8, 32 GPUs."""
    gen_entry = projection_batch(results["generator"], args.projection_batch)
    dino = rate(results["dinov2"], "images_per_s")
    clip_img = rate(results["clip"]["image"], "images_per_s")
    clip_txt = rate(results["clip"]["text"], "texts_per_s")
    per_image_s: dict[str, float | None] = {
        "dinov2": 1 / dino if dino else None,
        "clip_image": 1 / clip_img if clip_img else None,
        "clip_text": args.clip_texts_per_image / clip_txt if clip_txt else None,
    }
    for tier in tiers(args):
        per_image_s[f"caption_{tier.name}"] = (
            tier.seconds_per_image(gen_entry["prefill_s"], gen_entry["decode_step_s"], gen_entry["batch"])
            if gen_entry else None)
    gpus: dict[str, dict[str, float | None]] = {}
    for n in GPU_COUNTS:
        hours = {part: (s * args.images / n / 3600 if s is not None else None) for part, s in per_image_s.items()}
        known = [h for h in hours.values() if h is not None]
        hours["captions_total"] = (sum(hours[f"caption_{t.name}"] for t in tiers(args)) if gen_entry else None)
        hours["total"] = sum(known) if len(known) == len(per_image_s) else None
        gpus[str(n)] = hours
    return {
        "images": args.images,
        "generation_batch": gen_entry["batch"] if gen_entry else None,
        "tiers": [t.__dict__ for t in tiers(args)],
        "per_image_gpu_seconds": per_image_s,
        "requests_per_image": sum(t.requests_per_image for t in tiers(args)),
        "generated_tokens_per_image": sum(t.tokens_per_image for t in tiers(args)),
        "gpus": gpus,
        "assumptions": assumptions(args, gen_entry, results["meta"]["device_name"]),
    }


# -- report --------------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for name, entry, unit in (("DINOv2-L/14", results["dinov2"], "images"),
                              ("CLIP ViT-L/14 image", results["clip"]["image"], "images"),
                              ("CLIP ViT-L/14 text", results["clip"]["text"], "texts")):
        rows.append((name, str(entry["batch"]), entry["status"], fmt(entry.get("seconds"), 3),
                     f"{fmt(entry.get(f'{unit}_per_s'))} {unit}/s"))
    new = results["generator"]["new_tokens"]
    for key, entry in results["generator"]["batches"].items():
        lens = entry.get("generated_lengths")
        tok = f"{fmt(entry.get('tokens_per_s'))} tok/s, {fmt(entry.get('requests_per_s'), 3)} req/s"
        if lens:
            tok += f", gen len {min(lens)}..{max(lens)} (want {new}), prefill {fmt(entry['prefill_s'], 3)} s"
        rows.append((f"Qwen2-VL-2B generate x{new}", key, entry["status"], fmt(entry.get("seconds"), 3), tok))
    return rows


def print_table(results: dict[str, Any]) -> None:
    meta = results["meta"]
    print(f"\nThroughput on {meta['device_name']} ({meta['dtype']}, random weights from config"
          f"{', TINY configs' if meta['tiny'] else ''})")
    header = ("model", "batch", "status", "seconds", "throughput")
    rows = [header, *table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4])


def print_projection(proj: dict[str, Any]) -> None:
    print(f"\nProjection: {proj['images']:,}-image three-tier build "
          f"({proj['requests_per_image']} generation requests and {proj['generated_tokens_per_image']} "
          f"generated tokens per image)")
    parts = list(proj["gpus"]["1"].keys())
    print("  " + "GPUs".ljust(6) + "".join(p.rjust(16) for p in parts))
    for n, hours in proj["gpus"].items():
        print("  " + n.ljust(6) + "".join(f"{fmt(hours[p], 2)} h".rjust(16) for p in parts))
    print("  assumptions:")
    for line in proj["assumptions"]:
        print(f"   - {line}")


# -- main ----------------------------------------------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[1]
PATH_FLOWS = ("build-secmm", "build-largefine")


def flow_report(summary: dict[str, Any]) -> dict[str, Any]:
    """What a path check keeps of a flow's summary."""
    return {"inputs": summary.get("inputs"), "balanced": bool(summary.get("balanced")),
            "accepted": summary.get("accepted"), "rejected": summary.get("rejected", {}),
            "stages": [{k: s.get(k) for k in ("stage", "input", "accepted", "rejected")}
                       for s in summary.get("stages", [])]}


def check_path(args: argparse.Namespace) -> dict[str, Any]:
    """The tiny-production flows on ``args.device`` (see the module docstring, item 4)."""
    sys.path.insert(0, str(ROOT))
    try:
        from entry.tiny_production import PathRun
    except ImportError as exc:
        return {"status": "skipped", "reason": f"the project's environment is not installed here ({exc}): "
                                               "run `make setup` to check the path too"}
    workdir = args.path_dir or Path(tempfile.mkdtemp(prefix="rde-tiny-production-"))
    run = PathRun(workdir, device=args.device)
    started = time.perf_counter()
    outcomes = run.run(args.path_flows, stop_on=(Exception,))
    flows = {o.flow: {"seconds": round(o.seconds, 1),
                      **({"error": o.error[:2000]} if o.error else flow_report(o.summary or {}))} for o in outcomes}
    ok = all("error" not in f and f["balanced"] for f in flows.values())
    return {"status": "ok" if ok else "failed", "device": args.device, "generator_backend": run.generator_backend,
            "workdir": str(run.workdir), "seconds": round(time.perf_counter() - started, 1), "flows": flows}


def print_path(path: dict[str, Any]) -> None:
    print(f"\nProduction path on tiny models: {path['status']}")
    if path["status"] == "skipped":
        print(f"  {path['reason']}")
        return
    print(f"  device {path['device']}, generators through {path['generator_backend']}, {path['seconds']} s, "
          f"artifacts in {path['workdir']}")
    for flow, entry in path["flows"].items():
        if "error" in entry:
            print(f"  {flow}: stopped after {entry['seconds']} s: {entry['error'][:300]}")
            continue
        rejected = sum(entry["rejected"].values())
        print(f"  {flow}: {entry['seconds']} s, {entry['inputs']} inputs, balanced {entry['balanced']}, "
              f"{rejected} rejected rows ({len(entry['rejected'])} stage:reason kinds)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = " (default: %(default)s)"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--tiny", action="store_true",
                   help="tiny configs (2 layers, hidden 64), batch 4, 8 new tokens, batches 1,2,4: a CPU smoke run")
    p.add_argument("--json", type=Path, default=Path("gpu-check.json"), help="where to write all figures" + d)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="generator batch sizes, comma-separated (default 1,16,64; tiny 1,2,4)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 128; tiny 8)")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="stop adding measurements once the next would end past this many seconds" + d)
    p.add_argument("--embed-batch", type=int, default=None, help="embedder batch (default 256; tiny 4)")
    p.add_argument("--iters", type=int, default=None, help="timed embedder iterations (default 10; tiny 2)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="text tokens around the image in each prompt" + d)
    p.add_argument("--image-size", type=int, default=224, help="generator input image side (multiple of 28)" + d)
    p.add_argument("--path", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the production path on tiny models (profiles/tiny-production.yaml)" + d)
    p.add_argument("--path-flows", type=lambda s: tuple(s.split(",")), default=PATH_FLOWS,
                   help="flows of the path check, comma-separated (default: build-secmm,build-largefine)")
    p.add_argument("--path-dir", type=Path, default=None,
                   help="working folder of the path check (tiny models, slice, artifacts; default: a temp folder)")
    g = p.add_argument_group("projection")
    g.add_argument("--images", type=int, default=1_200_000, help="images in the projected build" + d)
    g.add_argument("--projection-batch", type=int, default=None,
                   help="generator batch to project with (default: largest measured)")
    g.add_argument("--base-tokens", type=int, default=180,
                   help="base tier generated tokens/image: ~4 Q&A pairs (~100) + summary (~80)" + d)
    g.add_argument("--base-requests", type=int, default=2, help="base tier requests/image (Q&A, summary)" + d)
    g.add_argument("--base-images", type=int, default=1, help="images per base request" + d)
    g.add_argument("--inter-tokens", type=int, default=200,
                   help="intermediate tier tokens/image: comparison Q&A (~120) + summary (~80)" + d)
    g.add_argument("--inter-requests", type=int, default=2, help="intermediate tier requests/image" + d)
    g.add_argument("--inter-images", type=int, default=2,
                   help="images per intermediate request (target + hard negative)" + d)
    g.add_argument("--adv-tokens", type=int, default=60, help="advanced tier tokens/image: one ~60-token caption" + d)
    g.add_argument("--adv-requests", type=int, default=1, help="advanced tier requests/image" + d)
    g.add_argument("--adv-images", type=int, default=1, help="images per advanced request" + d)
    g.add_argument("--clip-texts-per-image", type=int, default=0,
                   help="CLIP text embeddings per image (e.g. 3 to embed each tier's caption)" + d)
    args = p.parse_args(argv)
    tiny_defaults = {"batches": [1, 2, 4], "new_tokens": 8, "embed_batch": 4, "iters": 2}
    full_defaults = {"batches": [1, 16, 64], "new_tokens": 128, "embed_batch": 256, "iters": 10}
    for key, value in (tiny_defaults if args.tiny else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    # entry.tiny_production.FLOWS, spelled out: this script parses its arguments without the project
    known = ("build-secmm", "build-largefine", "train-saft", "train-gtr", "train-vedje", "index-cache", "rerank")
    if unknown := [f for f in args.path_flows if f not in known]:
        p.error(f"--path-flows: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if args.image_size % 28:
        p.error("--image-size must be a multiple of 28 (patch 14 x merge 2)")
    return args


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = Budget(args.time_budget_s)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    results: dict[str, Any] = {"meta": {
        "device": str(device), "device_name": device_name(device), "dtype": args.dtype, "tiny": args.tiny,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
        "weights": "random, built from config", "time_budget_s": args.time_budget_s,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}}
    print("DINOv2 ...", flush=True)
    results["dinov2"] = check_dinov2(args, device, dtype)
    release(device)
    print("CLIP ...", flush=True)
    results["clip"] = check_clip(args, device, dtype)
    release(device)
    print("Qwen2-VL generator ...", flush=True)
    results["generator"] = check_generator(args, device, dtype, budget)
    release(device)
    results["projection"] = project(args, results)
    if args.path:
        print("production path on tiny models ...", flush=True)
        results["path"] = check_path(args)
    results["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print_table(results)
    print_projection(results["projection"])
    if "path" in results:
        print_path(results["path"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json} ({results['meta']['elapsed_s']} s)")
    return 1 if results.get("path", {}).get("status") == "failed" else 0


if __name__ == "__main__":
    raise SystemExit(main())

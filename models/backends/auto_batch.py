"""Batch sizes chosen by measurement (``batch_size: auto``), shared by every batched backend.

On the first call in a process a backend hands its own first inputs and its batched forward to
``BatchSize.resolve``; that times a few batch sizes on them (a warm-up call, then the fastest of
``repeats`` calls each) and keeps the size with the fastest time per item, the smallest one
within ``tolerance`` of it. On CPU the fastest is often small (cache-bound convolutions); on an
accelerator it is usually the largest that fits, so there it also stops at the memory budget
(share ``memory_fraction`` of the memory free when measuring starts; peak use is measured per
size and extrapolated linearly to the next one, the way ultralytics' AutoBatch fits it).

The choice is logged and cached per (backend, model, operation, device, machine, settings): in
memory for the process and, when a cache file is configured (the registry uses
``<state dir>/auto_batch.json``; ``RDE_AUTO_BATCH_CACHE`` names another), on disk, so a rerun
does not measure again. A number in the profile always wins and is never measured. Batch size
does not change results beyond float tolerance, so it stays out of artifact stage keys: the
measured size depends on the machine, and a shard computed at another size may differ in its
floats' last bits (never in what the stage decides beyond that tolerance, nor in a key).

Settings come from ``options.auto_batch`` of the model spec (see ``AutoBatchSettings``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from itertools import cycle, islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
AUTO = "auto"
CACHE_ENV = "RDE_AUTO_BATCH_CACHE"
logger = logging.getLogger(__name__)
# model options that change how fast each batch size runs, so they are part of a choice's identity
SPEED_SHAPING_OPTIONS = frozenset({"fold_batch_norm", "channels_last"})
_clock = time.perf_counter  # a module attribute so tests can drive measurement with a fake clock


@dataclass(frozen=True)
class AutoBatchSettings:
    """How ``auto`` measures; override any field with ``options: {auto_batch: {field: value}}``."""

    cpu_candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    accelerator_candidates: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
    repeats: int = 3  # timed calls per size after one warm-up call; the fastest counts (shared CPUs are noisy)...
    enough_seconds: float = 1.0  # ...fewer once a size's timed calls took this long (noise is small then)
    tolerance: float = 0.05  # the smallest size within this share of the fastest per-item time wins
    stop_when_slower: float = 1.5  # a size this much slower per item than the best counts as worse...
    patience: int = 2  # ...and this many worse sizes in a row stop the search (one noisy size does not)
    max_seconds: float = 120.0  # stop trying larger sizes once measuring took this long...
    min_sizes: int = 4  # ...but only after this many sizes (a loaded machine must not pin the smallest)
    memory_fraction: float = 0.8  # accelerator: share of the free memory a batch may peak at

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> AutoBatchSettings:
        """Defaults overridden by the spec's ``options.auto_batch`` mapping (unknown keys are errors)."""
        given = dict(options.get("auto_batch") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"options.auto_batch: unknown keys {unknown} (known: {sorted(known)})")
        for name in ("cpu_candidates", "accelerator_candidates"):
            if name in given:
                given[name] = tuple(sorted({int(x) for x in given[name]}))
        return cls(**given)

    def candidates(self, device: torch.device) -> tuple[int, ...]:
        return self.cpu_candidates if device.type == "cpu" else self.accelerator_candidates


@dataclass
class Measurement:
    """One size's result: seconds per item (fastest call) and peak accelerator bytes (0 on CPU)."""

    batch: int
    seconds_per_item: float
    peak_bytes: int = 0


def machine_fingerprint(device: torch.device) -> str:
    """What makes timings of one machine differ from another's: host, CPU, threads, accelerator."""
    import torch

    return _machine_fingerprint(str(device), torch.get_num_threads())


@functools.lru_cache(maxsize=16)
def _machine_fingerprint(device_name: str, threads: int) -> str:
    """``machine_fingerprint``, read once per (device, thread count): it is consulted on every call."""
    import torch

    device = torch.device(device_name)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [platform.node(), cpu, f"cores={os.cpu_count()}", f"threads={threads}",
             f"torch={torch.__version__}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts.append(f"{props.name}/{props.total_memory >> 20}MiB")
    return "|".join(parts)


def choose(measured: Sequence[Measurement], tolerance: float) -> int:
    """The smallest batch whose per-item time is within ``tolerance`` of the fastest."""
    best = min(m.seconds_per_item for m in measured)
    return min(m.batch for m in measured if m.seconds_per_item <= best * (1.0 + tolerance))


_memo: dict[str, dict[str, Any]] = {}
_memo_lock = threading.Lock()
_measure_lock = threading.RLock()  # one measurement at a time per process: two would time each other
_cache_file: Path | None = None


def set_cache_file(path: Path | None) -> None:
    """Where chosen sizes persist across processes (``None``: only ``RDE_AUTO_BATCH_CACHE`` or memory)."""
    global _cache_file
    _cache_file = path


def cache_file() -> Path | None:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else _cache_file


def _read_disk(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("auto batch: ignoring unreadable cache %s", path)
        return {}
    return data if isinstance(data, dict) else {}


def _write_disk(path: Path | None, key: str, entry: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_disk(path)
    data[key] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a reader sees the old file or the new one


def forget(key_prefix: str = "") -> None:
    """Drop in-process choices (tests; a benchmark that wants to measure again)."""
    with _memo_lock:
        for key in [k for k in _memo if k.startswith(key_prefix)]:
            del _memo[key]


class BatchSize:
    """The batch size of one backend operation: the spec's number, or ``auto`` measured on first use."""

    def __init__(self, setting: int | str, identity: str, device: torch.device | str,
                 settings: AutoBatchSettings | None = None) -> None:
        import torch  # here, not at import: a process that batches no torch model never loads torch

        self.setting = setting
        self.device = torch.device(device)
        self.settings = settings or AutoBatchSettings()
        self.identity = identity
        self.last: dict[str, Any] | None = None  # the entry behind the latest auto choice (curve, source)

    @property
    def is_auto(self) -> bool:
        return self.setting == AUTO

    def key(self, operation: str) -> str:
        return " | ".join([self.identity, operation, str(self.device), machine_fingerprint(self.device),
                           json.dumps(asdict(self.settings), sort_keys=True)])

    def resolve(self, operation: str, items: Sequence[T], run: Callable[[Sequence[T]], object]) -> int:
        """The batch size for ``operation``; on the first auto call, measured with ``run`` on ``items``."""
        if not self.is_auto:
            return int(self.setting)
        if len(items) <= 1:
            return 1  # nothing to choose; do not measure on one item
        key = self.key(operation)
        with _memo_lock:
            entry = _memo.get(key)
        if entry is None:
            with _measure_lock:
                with _memo_lock:
                    entry = _memo.get(key)
                if entry is None:
                    entry = self._load_or_measure(key, operation, items, run)
                    with _memo_lock:
                        _memo[key] = entry
        self.last = entry
        return int(entry["batch_size"])

    def _load_or_measure(self, key: str, operation: str, items: Sequence[T],
                         run: Callable[[Sequence[T]], object]) -> dict[str, Any]:
        path = cache_file()
        entry = _read_disk(path).get(key)
        if entry is not None:
            logger.info("auto batch: %s %s on %s: batch %d (cached in %s)", self.identity, operation, self.device,
                        entry["batch_size"], path)
            return {**entry, "source": "cache"}
        measured = self.measure(items, run)
        chosen = choose(measured, self.settings.tolerance)
        entry = {"batch_size": chosen, "identity": self.identity, "operation": operation,
                 "curve": {str(m.batch): round(1.0 / m.seconds_per_item, 2) for m in measured},
                 "peak_bytes": {str(m.batch): m.peak_bytes for m in measured if m.peak_bytes},
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        curve = ", ".join(f"{b}: {v:.1f}/s" for b, v in entry["curve"].items())
        logger.info("auto batch: %s %s on %s: batch %d (items/s by batch: %s)", self.identity, operation,
                    self.device, chosen, curve)
        _write_disk(path, key, entry)
        return {**entry, "source": "measured"}

    def measure(self, items: Sequence[T], run: Callable[[Sequence[T]], object]) -> list[Measurement]:
        """Per-item time of each candidate size on ``items`` (repeated cyclically up to the size)."""
        import torch

        s, cuda = self.settings, self.device.type == "cuda"
        budget = s.memory_fraction * torch.cuda.mem_get_info(self.device)[0] if cuda else float("inf")
        started, out, worse = _clock(), [], 0
        for batch in s.candidates(self.device):
            if cuda and len(out) >= 2 and _extrapolate(out[-2], out[-1], batch) > budget:
                break
            sample = list(islice(cycle(items), batch))
            try:
                result = self._time(sample, run, cuda)
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError and MPS's plain RuntimeError
                if "out of memory" not in str(exc).lower():
                    raise
                if cuda:
                    torch.cuda.empty_cache()
                break
            if result.peak_bytes > budget:
                break
            out.append(result)
            best = min(m.seconds_per_item for m in out)
            worse = worse + 1 if result.seconds_per_item > best * s.stop_when_slower else 0
            if worse >= s.patience or (len(out) >= s.min_sizes and _clock() - started > s.max_seconds):
                break
        if not out:  # even the smallest size exceeded the budget: use it anyway, the caller's call will tell
            out.append(Measurement(s.candidates(self.device)[0], float("inf")))
        return out

    def _time(self, sample: list[T], run: Callable[[Sequence[T]], object], cuda: bool) -> Measurement:
        import torch

        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        run(sample)  # warm-up: kernel selection, allocator growth
        times = []
        while len(times) < max(1, self.settings.repeats) and sum(times) < self.settings.enough_seconds:
            start = _clock()
            run(sample)
            if cuda:
                torch.cuda.synchronize(self.device)
            times.append(_clock() - start)
        peak = torch.cuda.max_memory_allocated(self.device) - base if cuda else 0
        return Measurement(len(sample), min(times) / len(sample), int(peak))


def _extrapolate(a: Measurement, b: Measurement, batch: int) -> float:
    """Peak bytes at ``batch`` on the line through two measured sizes."""
    slope = (b.peak_bytes - a.peak_bytes) / max(1, b.batch - a.batch)
    return b.peak_bytes + slope * (batch - b.batch)



def for_spec(spec: Any, device: torch.device | str) -> BatchSize:
    """A backend's batch size from its model spec (``backend``, ``model_id``, ``revision``, ``dtype``,
    ``batch_size``, ``options``); duck-typed so this module needs nothing from the layers above."""
    identity = f"{spec.backend}:{spec.model_id}@{spec.revision or 'main'}:{spec.dtype}"
    shaping = {k: v for k, v in sorted(spec.options.items()) if k in SPEED_SHAPING_OPTIONS}
    if shaping:  # a folded or channels-last network has its own curve
        identity += ":" + json.dumps(shaping, sort_keys=True)
    return BatchSize(spec.batch_size, identity, device, AutoBatchSettings.from_options(spec.options))

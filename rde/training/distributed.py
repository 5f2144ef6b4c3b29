"""Data-parallel training over processes (``torch.distributed``; ``gloo`` on CPUs, ``nccl`` on GPUs).

Each step's global batch (the seeded order's next ``batch_size`` pairs, the same on every rank) is
cut into one contiguous part per rank (``local_part``). A rank encodes only its part; the image and
text embeddings are then gathered across ranks with autograd (``gather_rows``), so every rank
computes the loss of the **whole global batch**, as the papers' in-batch losses assume: ITC's
negatives and the SASS / ISD soft targets (SAFT Eq. 5-7) range over the global batch, not a rank's
slice. The teacher targets need no gathering: they are fixed inputs, indexed by the global batch's
pair ids on every rank (each rank holds the teacher vectors of the pairs it may be given).

Gradients: the gather's backward sums, over ranks, each rank's gradient for the embeddings it
contributed, so a rank's parameter gradient is ``world ×`` the part of ∂L/∂θ that flows through its
own embeddings; parameters used on the gathered tensors directly (the temperature, the ITM head)
get the whole ∂L/∂θ on every rank. ``average_gradients`` then all-reduces and divides by ``world``
(what ``DistributedDataParallel`` does), which gives exactly ∂L/∂θ of the global batch on every
rank: the one-process step, up to float summation order.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group."""

    rank: int
    world: int


def current() -> Ranks | None:
    """The process group this process trains in, or None (one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Ranks(dist.get_rank(), dist.get_world_size())
    return None


def local_part(batch: torch.Tensor, ranks: Ranks | None) -> torch.Tensor:
    """This rank's contiguous part of a global batch (parts differ by at most one row)."""
    return batch if ranks is None else batch.tensor_split(ranks.world)[ranks.rank]


def gather_rows(x: torch.Tensor, ranks: Ranks | None) -> torch.Tensor:
    """Every rank's rows of ``x`` in rank order, differentiable (the backward sums the gradients of
    each rank's rows onto that rank). Parts may differ in length: each is padded to the longest for
    the collective, then trimmed."""
    if ranks is None:
        return x
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(ranks.world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], dtype=torch.long, device=x.device))
    longest = max(int(s) for s in sizes)
    padded = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])]) if x.shape[0] < longest else x
    with warnings.catch_warnings():  # its named successor is a private module (_functional_collectives)
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
        parts = dist_fn.all_gather(padded)
    return torch.cat([part[:int(n)] for part, n in zip(parts, sizes, strict=True)])


def average_gradients(params: Iterable[torch.nn.Parameter], ranks: Ranks | None) -> None:
    """All-reduce every gradient and divide by the world size (module docstring)."""
    if ranks is None:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= ranks.world


def run_group(fn: Callable[..., Any], world: int, init_file: str, backend: str = "gloo", *args: Any,
              on_poll: Callable[[], None] | None = None) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes, each in the process group (its
    rendezvous a file that must not exist yet, so no port is needed), calling ``on_poll`` about
    twice a second meanwhile; an exception in any of them is raised here."""
    group = torch.multiprocessing.spawn(_member, args=(fn, world, init_file, backend, args), nprocs=world,
                                        join=False)
    while not group.join(timeout=0.5):
        if on_poll is not None:
            on_poll()
    if on_poll is not None:
        on_poll()


def _member(rank: int, fn: Callable[..., Any], world: int, init_file: str, backend: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()

"""Data-parallel training on the CPU (``gloo``, two processes): a step's loss and gradients are those
of one process on the same global batch (SAFT's soft targets and ITM over the gathered batch, GTR+
weights, parts of unequal size), and a two-process training run ends with the one-process model.
``train_data_parallel`` (the stage's way in, with rank 0's progress, losses and checkpoints) runs in
the train-gtr flow test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_retrieval_training import _model, _pairs

from rde.training.distributed import average_gradients, current, run_group
from rde.training.retrieval_training import TrainConfig, batch_loss, train

STEP = TrainConfig(objective="saft", use_itm=True, batch_size=15, seed=3)
RUN = TrainConfig(objective="saft", epochs=2, batch_size=15, lr_start=1e-3, lr_peak=1e-2, seed=3)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    idx = torch.randperm(48, generator=g)[:15]  # 15 pairs: parts of 8 and 7
    return idx, torch.randint(3, (15,), generator=g), torch.rand(15, generator=g) + 0.5


def _step(ranks: object) -> dict[str, object]:
    model, pairs = _model(), _pairs()
    idx, views, weights = _batch()
    terms = batch_loss(model, pairs, idx, views, STEP, weights, ranks)
    terms["total"].backward()
    params = [p for p in model.parameters() if p.requires_grad]
    average_gradients(params, ranks)
    return {"terms": {k: float(v.detach()) for k, v in terms.items()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _member(rank: int, world: int, out: str) -> None:
    step = _step(current())
    model = _model()
    result = train(model, _pairs(), RUN)  # in the group: data-parallel
    if rank == 0:
        torch.save({"step": step, "model": model.state_dict(), "losses": result.step_losses}, out)


def test_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    """One process group for both checks (starting one costs seconds of imports)."""
    out = tmp_path / "rank0.pt"
    run_group(_member, 2, str(tmp_path / "rendezvous"), "gloo", str(out))
    two = torch.load(out, weights_only=False)
    one = _step(None)
    assert set(two["step"]["terms"]) == set(one["terms"]) >= {"itc", "sass", "isd", "itm", "total"}
    for name, value in one["terms"].items():
        assert two["step"]["terms"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert set(two["step"]["grads"]) == set(one["grads"]) and one["grads"]
    for name, grad in one["grads"].items():
        assert torch.allclose(two["step"]["grads"][name], grad, rtol=1e-4, atol=1e-6), name

    # a whole data-parallel run: the same steps, losses and final weights as one process
    whole = _model()
    reference = train(whole, _pairs(), RUN)
    assert [s["step"] for s in two["losses"]] == [s["step"] for s in reference.step_losses] == list(range(1, 9))
    assert [s["total"] for s in two["losses"]] == pytest.approx([s["total"] for s in reference.step_losses],
                                                                rel=1e-5)
    for name, value in whole.state_dict().items():
        assert torch.allclose(two["model"][name], value, rtol=1e-4, atol=1e-5), name

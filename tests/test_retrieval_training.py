"""The training loop on small synthetic features: schedule, determinism, resume from checkpoints,
every objective runs and lowers its loss, GTR+ weighting turns on after the first epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.retrieval.dual_encoder import FeatureDualEncoder
from rde.training.retrieval_training import TrainConfig, TrainingPairs, loss_terms, lr_at, train


def _pairs(n_img: int = 24, per_image: int = 2, d: int = 8, c: int = 6, seed: int = 0) -> TrainingPairs:
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(n_img, d, generator=g), dim=1)
    bridge = centres + 0.3 * torch.randn(3, n_img, d, generator=g)
    cnn = torch.randn(3, n_img, c, generator=g)
    pair_image = torch.arange(n_img).repeat_interleave(per_image)
    texts = centres[pair_image] + 0.3 * torch.randn(len(pair_image), d, generator=g)
    return TrainingPairs(torch.cat([bridge, cnn], dim=2), pair_image, texts, centres + 0.1,
                         texts + 0.05, torch.rand(len(pair_image), generator=g))


def _model() -> FeatureDualEncoder:
    torch.manual_seed(0)
    return FeatureDualEncoder(bridge_dim=8, cnn_dim=6, text_dim=8)


def test_schedule_warms_up_linearly_then_anneals() -> None:
    cfg = TrainConfig(lr_start=5e-7, lr_peak=5e-6, warmup_frac=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(5e-7)
    assert lr_at(5, 100, cfg) == pytest.approx(5e-7 + 4.5e-6 * 0.5)
    assert lr_at(10, 100, cfg) == pytest.approx(5e-6)
    assert lr_at(55, 100, cfg) == pytest.approx(2.5e-6)
    assert lr_at(100, 100, cfg) == pytest.approx(0.0, abs=1e-12)


def test_zero_shot_model_is_the_bridge_and_the_text_tower_is_frozen() -> None:
    model = _model()
    x = torch.randn(4, 14)
    assert torch.allclose(model.encode_image(x), torch.nn.functional.normalize(x[:, :8], dim=1), atol=1e-6)
    assert not any(p.requires_grad for p in model.txt_proj.parameters())
    assert all(p.requires_grad for p in FeatureDualEncoder(8, 6, 8, train_text=True).txt_proj.parameters())


@pytest.mark.parametrize("objective", ["itc", "itc+sass", "saft", "cusa", "hnm", "itc+iss"])
def test_every_objective_trains_and_lowers_its_loss(objective: str) -> None:
    model = _model()
    result = train(model, _pairs(), TrainConfig(objective=objective, epochs=6, batch_size=16, lr_start=1e-3,
                                                lr_peak=1e-2, warmup_frac=0.1))
    assert result.epochs[-1].mean_loss < result.epochs[0].mean_loss
    assert np.isfinite([s["total"] for s in result.step_losses]).all()
    assert ("sass" in result.step_losses[0]) == (objective in ("itc+sass", "saft"))
    assert ("isd" in result.step_losses[0]) == (objective == "saft")


def _gradient(objective: str) -> torch.Tensor:
    """The gradient of ``loss_terms(...)["total"]`` (the objective picked by name, as ``train`` does)
    over every parameter it reaches (image tower and τ), on one fixed batch of 16 pairs (8 images, two
    captions each)."""
    model, pairs = _model(), _pairs()
    batch = pairs.batch(torch.arange(16), torch.zeros(16, dtype=torch.long), other_view=objective == "itc+iss")
    loss_terms(model, batch, TrainConfig(objective=objective), None)["total"].backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("objective", ["itc+sass", "saft", "cusa", "hnm", "itc+iss"])
def test_each_objective_by_name_has_a_gradient_of_its_own(objective: str) -> None:
    """Routing an objective's name to plain ITC would still lower its loss; its gradient would be
    ITC's. Each differs from ITC's by more than 1 % of ITC's norm (float32; a real term moves it by far more)."""
    itc = _gradient("itc")
    assert torch.isfinite(itc).all() and itc.norm() > 0
    other = _gradient(objective)
    assert (other - itc).norm() > 1e-2 * itc.norm(), objective


def test_seeded_runs_are_identical_and_a_resumed_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    cfg = TrainConfig(objective="saft", epochs=4, batch_size=16, lr_start=1e-3, lr_peak=1e-2, seed=3)
    a, b = _model(), _model()
    train(a, _pairs(), cfg)
    train(b, _pairs(), cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    train(_model(), _pairs(), cfg, checkpoint_dir=tmp_path)
    saved = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert saved == ["step-000000009.pt", "step-000000012.pt"]  # 3 steps an epoch; the newest two are kept
    (tmp_path / saved[-1]).unlink()  # as if killed during the last epoch, before its end
    resumed = _model()
    result = train(resumed, _pairs(), cfg, checkpoint_dir=tmp_path)
    assert result.resumed_from == 3 and result.resumed_step == 9 and [e.epoch for e in result.epochs] == [3]
    for x, y in zip(a.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)


KILLED_RUN = """
import os, signal, sys
from test_retrieval_training import _model, _pairs
from rde.training.retrieval_training import TrainConfig, train
cfg = TrainConfig(objective="saft", epochs=4, batch_size=16, lr_start=1e-3, lr_peak=1e-2, seed=3, checkpoint_every=2)
def on_step(done, total):
    if done == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
train(_model(), _pairs(), cfg, checkpoint_dir=sys.argv[1], on_step=on_step)
"""


def test_a_run_killed_mid_epoch_resumes_at_its_last_step_checkpoint(tmp_path: Path) -> None:
    """SIGKILL at step 5, in the middle of epoch 1 (3 steps an epoch; a checkpoint every 2 steps):
    the rerun goes on from step 4's checkpoint at the next batch of epoch 1's order, so no pair of
    that epoch is trained on twice, and it ends where the uninterrupted run ends."""
    import os
    import subprocess
    import sys

    cfg = TrainConfig(objective="saft", epochs=4, batch_size=16, lr_start=1e-3, lr_peak=1e-2, seed=3,
                      checkpoint_every=2)
    whole = _model()
    reference = train(whole, _pairs(), cfg)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path), "5"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["step-000000003.pt", "step-000000004.pt"]
    resumed = _model()
    result = train(resumed, _pairs(), cfg, checkpoint_dir=tmp_path)
    assert result.resumed_from == 1 and result.resumed_step == 4
    assert [s["step"] for s in result.step_losses] == list(range(5, 13))  # each remaining step once
    assert result.epochs[0].mean_loss == pytest.approx(reference.epochs[1].mean_loss, rel=1e-6)  # the whole epoch
    for x, y in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)


def test_adaptive_weighting_fits_a_gmm_after_each_epoch_and_fixweight_uses_q_txt() -> None:
    pairs = _pairs()
    result = train(_model(), pairs, TrainConfig(weighting="ada", use_itm=True, epochs=3, batch_size=16,
                                                lr_start=1e-3, lr_peak=1e-2))
    assert all(len(e.gmm_means) == 2 and e.confidence is not None for e in result.epochs)
    assert "itm" in result.step_losses[0]
    with pytest.raises(ValueError, match="q_txt"):
        train(_model(), TrainingPairs(pairs.images, pairs.pair_image, pairs.texts), TrainConfig(weighting="fix"))


def test_a_resumed_run_warm_starts_its_gmm_refit_from_the_checkpointed_fit(tmp_path: Path) -> None:
    """GTR+'s refit after each epoch starts EM from the previous epoch's fit; that fit is in the
    checkpoint, so a run resumed after epoch 1 refits epoch 2 as the uninterrupted run does (as many
    EM iterations, the same confidences), not from a cold k-means start."""
    cfg = TrainConfig(weighting="ada", use_itm=True, epochs=3, batch_size=16, lr_start=1e-3, lr_peak=1e-2)
    reference = train(_model(), _pairs(), cfg)
    train(_model(), _pairs(), cfg, checkpoint_dir=tmp_path)
    newest = sorted(tmp_path.glob("*.pt"))[-1]
    newest.unlink()  # as if killed during the last epoch: resume from epoch 1's end
    resumed = train(_model(), _pairs(), cfg, checkpoint_dir=tmp_path)
    assert resumed.resumed_from == 2 and [e.epoch for e in resumed.epochs] == [2]
    assert resumed.epochs[0].gmm_iterations == reference.epochs[2].gmm_iterations
    assert reference.epochs[2].gmm_iterations[0] < reference.epochs[0].gmm_iterations[0]  # warm: fewer
    assert np.allclose(resumed.epochs[0].confidence, reference.epochs[2].confidence, atol=1e-5)


def test_production_clip_dual_encoder_trains_the_vision_tower_only(tmp_path: Path) -> None:
    from tiny_models import build_tiny_clip, random_images

    from models.retrieval.dual_encoder import HFClipDualEncoder
    from models.retrieval.losses import itc_loss

    model = HFClipDualEncoder(str(build_tiny_clip(tmp_path / "clip")))
    img = model.encode_image(model.pixel_values(random_images(4)))
    txt = model.encode_text(model.tokens(["a red coat", "a white van", "a person", "a blue bag"]))
    assert img.shape == (4, 16) and torch.allclose(img.norm(dim=1), torch.ones(4), atol=1e-5)
    itc_loss(img, txt, model.tau).backward()
    vision = [p.grad for n, p in model.model.named_parameters() if n.startswith("vision_model")]
    text = [p.grad for n, p in model.model.named_parameters() if n.startswith("text_model")]
    assert any(g is not None and g.abs().sum() > 0 for g in vision)
    assert all(g is None for g in text)  # frozen, as SAFT fine-tunes the image tower only


def test_a_last_batch_of_one_pair_is_not_a_step_of_the_schedule_or_the_progress() -> None:
    """24 images × 2 captions = 48 pairs; in batches of 47 each epoch has one batch of 47 and one of a
    single pair, which has no in-batch negative and is skipped: 1 step an epoch, 3 in all, and the
    progress reaches its total (it once stopped at 3 of 6, and the LR schedule never finished)."""
    seen: list[tuple[int, int]] = []
    result = train(_model(), _pairs(), TrainConfig(epochs=3, batch_size=47, lr_start=1e-3, lr_peak=1e-2),
                   on_step=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)] and len(result.step_losses) == 3


def test_training_threads_are_given_back_to_the_process() -> None:
    """Training runs on two torch threads and restores the process's own count after, also when it
    fails, so later stages in the same worker keep the float sums of a fresh process."""
    import torch

    from rde.training.training_log import torch_threads

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with torch_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 3
        with pytest.raises(RuntimeError), torch_threads(2):
            raise RuntimeError("a failed step")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)

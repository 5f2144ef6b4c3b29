"""The scale benchmark's scripted captioner (benchmarks/scripted_captioner.py) through the product's
own ``openai-http`` generator: every tier's prompt is answered in a form the tier checks accept,
with token log-probabilities, deterministically; and the benchmark's growth exponent."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from scale import exponent
from scripted_captioner import ScriptedServer

from models.backends.generators import OpenAIHttpGenerator
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde.largefine.config import LargeFineSpec
from rde.largefine.template_gallery import build_gallery
from rde.largefine.tiered_captions import TierCaptioner, TierImage, TierOutputs


def _items(n: int) -> list[TierImage]:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (64, 32, 3), dtype=np.uint8) for _ in range(n)]
    return [TierImage(f"img-{i}", f"pool:x:{i}", "pedestrian", images[i], 0, f"img-{(i + 1) % n}",
                      images[(i + 1) % n]) for i in range(n)]


def _run(base_url_spec: dict) -> tuple[TierOutputs, list[str]]:
    spec = LargeFineSpec()
    generator = OpenAIHttpGenerator(ModelSpec(**base_url_spec))
    captioner = TierCaptioner([generator], load_prompt("gtr_tiers"), spec)
    items, out = _items(16), TierOutputs()
    base = captioner.qa_tier(items, "base", out)
    inter = captioner.qa_tier(items, "inter", out)
    texts = [c["text"] for c in out.captions]
    gallery = build_gallery(generator.generate, texts[:12], load_prompt("gtr_template_gallery"),
                            captions_per_request=6, rounds=2, max_templates=64, min_words=6, max_words=60,
                            max_tokens=256, temperature=0.7, seed=0)
    assert sum(t.origin != "seed" for t in gallery.templates) >= 6, gallery.rejected
    captioner.advanced_tier(items, base, inter, gallery, out)
    generator.close()
    return out, [t.text for t in gallery.templates]


def test_scripted_captioner_passes_every_tier_check() -> None:
    with ScriptedServer() as server:
        out, templates = _run(server.spec())
        kinds = dict(server.counts)
    assert out.rejects == [], [(r["reason"], r["detail"]) for r in out.rejects]
    assert len(out.captions) == 3 * 16
    assert {c["tier"] for c in out.captions} == {"base", "inter", "adv"}
    assert kinds["base_qa"] == kinds["base_sum"] == kinds["inter_qa"] == kinds["inter_sum"] == kinds["adv"] == 16
    assert kinds["extract"] == 2 and kinds["expand"] == 2 and "unknown" not in kinds
    q = [c["q_txt"] for c in out.captions]
    assert all(0.55 <= v <= 0.98 for v in q) and len(set(q)) > 10  # logprobs came back and vary
    cleaning = [step for c in out.captions for step in c["cleaning"]]
    assert any(s.startswith("negative_mentions") for s in cleaning)  # the gates' cleaning ran
    for c in out.captions:  # one image's tiers describe the same person
        if c["tier"] == "adv":
            base = next(b["text"] for b in out.captions if b["image_id"] == c["image_id"] and b["tier"] == "base")
            shoes = " ".join(c["text"].rstrip(".").split()[-2:])  # "... and wears black sneakers."
            assert shoes in base
    with ScriptedServer() as server:  # deterministic: a second server answers the same
        again, templates_again = _run(server.spec())
    assert [c["text"] for c in again.captions] == [c["text"] for c in out.captions]
    assert templates_again == templates


def test_growth_exponent() -> None:
    assert math.isclose(exponent([500, 1000, 2000], [1.0, 2.0, 4.0]), 1.0)
    assert math.isclose(exponent([500, 1000, 2000], [3.0, 3.0, 3.0]), 0.0, abs_tol=1e-12)


def test_card_seconds_from_the_log(tmp_path: Path) -> None:
    from scale import card_seconds

    log = tmp_path / "build.log"
    log.write_text("10:49:59.516 | INFO    | Flow run 'x' - export-largefine: 3984/3984 accepted over 21 shards, 0.7s\n"
                   "10:50:14.965 | INFO    | Flow run 'x' - Finished in state Completed()\n")
    assert card_seconds(log) == 15.4
    log.write_text("10:49:59.516 | INFO    | Flow run 'x' - measure: 10/10 accepted\n")
    assert card_seconds(log) is None


def test_projection_generation_roofline_by_hand() -> None:
    """The assumed generation cost per image: prefill 17.6 TFLOP at 40 % of 989 TFLOP/s, decode 435
    tokens of 64-sequence steps reading 15.5 GB at 50 % of 3.35 TB/s (docs/results/scale.md)."""
    from scale import generator_seconds_per_image

    prefill, decode = generator_seconds_per_image()
    assert math.isclose(prefill, (2 * 7.0e9 * 1088 + 2 * 0.675e9 * 256 * 7) / (0.4 * 989e12))
    assert math.isclose(prefill, 0.0446, abs_tol=5e-4) and math.isclose(decode, 0.0628, abs_tol=5e-4)


def test_seed_from_secmm_links_the_pool_stages(tmp_path: Path) -> None:
    """build-largefine's output folder gets build-secmm's five pool-stage artifacts as hard links
    (same inode: no copy of a 100k pool); nothing else; a missing source says what to run."""
    from scale import POOL_STAGE_ARTIFACTS, seed_from_secmm

    source = tmp_path / "out-secmm-48" / "build-secmm" / "demo"
    for name in (*POOL_STAGE_ARTIFACTS, "gallery"):
        (source / name / "shards").mkdir(parents=True)
        (source / name / "_manifest.json").write_text("{}")
        (source / name / "shards" / "00000.parquet").write_bytes(name.encode())
    assert seed_from_secmm(tmp_path, 48) == list(POOL_STAGE_ARTIFACTS)
    target = tmp_path / "out-largefine-48" / "build-largefine" / "demo"
    assert sorted(p.name for p in target.iterdir()) == sorted(POOL_STAGE_ARTIFACTS)
    for name in POOL_STAGE_ARTIFACTS:
        linked = target / name / "shards" / "00000.parquet"
        assert linked.read_bytes() == name.encode()
        assert linked.stat().st_ino == (source / name / "shards" / "00000.parquet").stat().st_ino
    seed_from_secmm(tmp_path, 48)  # a second call (a resumed benchmark) leaves the links as they are
    (source / "measurements" / "_manifest.json").unlink()
    with pytest.raises(SystemExit, match="lacks measurements"):
        seed_from_secmm(tmp_path, 48)


def test_reused_stages_are_not_judged(capsys: pytest.CaptureFixture[str]) -> None:
    """A stage skipped in any run prints "reused" and stays out of the ±25 % check; the others do not."""
    from scale import print_table

    def result(n: int, reused: list[str]) -> dict:
        stages = {"ingest": {"seconds": 0.0}, "measure": {"seconds": 0.0},
                  "qa-tiers": {"seconds": n / 100}, "adv-tier": {"seconds": n / 400}}
        return {"n": n, "wall": n / 50, "rss": 2**31, "stages": stages, "captioned": n // 2, "reused": reused,
                "captioning": [], "requests": {}, "rejected": {}, "load_before": "", "load_after": ""}

    print_table("largefine", [result(1000, ["ingest", "measure"]), result(10000, ["ingest", "measure"])])
    out = capsys.readouterr().out
    assert "| measure | reused | reused | reused | reused | - |" in out
    assert "- measure:" not in out and "- ingest:" not in out
    assert "- qa-tiers: per-image time within 0% of its median" in out

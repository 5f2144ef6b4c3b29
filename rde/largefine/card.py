"""The LargeFine dataset card: GTR+ Table 1 statistics, retention per stage, per-source counts and
generator throughput, written at the run folder's top."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rde.common import caption_stats
from rde.common.dataset_cards import configs_header, loading_snippet
from rde.largefine.tier_inputs import table1_from_stats
from rde.largefine.tiered_captions import TIERS
from storage import Artifact

WDS_SNIPPET = ("WebDataset tars in `largefine_wds/` (one sample per captioned image: the image and a json of its "
               "tiers' texts), read with the `webdataset` library:", "", "```python",
               "import glob, webdataset as wds", "here = \".\"  # this card's folder",
               "tars = sorted(glob.glob(f\"{here}/largefine_wds/*.tar\"))",
               "for sample in wds.WebDataset(tars, shardshuffle=False).decode(\"pil\"):",
               "    image, texts = sample.get(\"jpg\") or sample.get(\"png\"), sample[\"json\"][\"texts\"]",
               "    break", "```")


CARD_FILES = ("README.md", "card.json")  # beside the artifact folders, never inside one
# The card's Hugging Face header: `load_dataset(run_folder[, "caption_rejects"])` reads these folders.
CARD_TABLES = ("largefine", "caption_rejects")
CARD_CONFIGS = configs_header(CARD_TABLES, default="largefine")


def write_card(run_folder: Path, card: str, stats: dict[str, Any]) -> None:
    """The dataset card at the run folder's top (a Hugging Face dataset layout: card at the root,
    Parquet in subfolders), so every artifact folder holds only shards and ``_manifest.json`` and
    opens with pandas, pyarrow and ``datasets``; a card left inside ``largefine/`` by an older
    version is removed."""
    (run_folder / CARD_FILES[0]).write_text(CARD_CONFIGS + card, encoding="utf-8")
    (run_folder / CARD_FILES[1]).write_text(json.dumps(stats, indent=1), encoding="utf-8")
    for name in CARD_FILES:
        (run_folder / "largefine" / name).unlink(missing_ok=True)


def corpus_statistics(texts_by_tier: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """GTR+ Table 1 columns per tier and overall (real POS tagger and noun chunker)."""
    nlp = caption_stats.load_tagger()
    out = {tier: caption_stats.text_statistics(texts, nlp) for tier, texts in texts_by_tier.items() if texts}
    out["all"] = caption_stats.text_statistics([t for texts in texts_by_tier.values() for t in texts], nlp)
    return out


def dataset_card(artifact_url: Callable[[str], str], profile_name: str, *, webdataset: bool
                 ) -> tuple[str, dict[str, Any]]:
    """Markdown card and its numbers (``card_stats``, then ``card_markdown``). ``artifact_url(name)``:
    where the run's artifact ``name`` is; ``webdataset``: the run also wrote WebDataset tars."""
    stats = card_stats(artifact_url)
    return card_markdown(stats, profile_name, webdataset=webdataset), stats


def card_stats(artifact_url: Callable[[str], str]) -> dict[str, Any]:
    """The card's numbers, read from the run's artifacts: Table 1 statistics, multi-granularity,
    retention per stage, per-source counts and generator throughput (``card.json``)."""
    captions = Artifact(artifact_url("largefine")).rows(["source", "generator"])
    table1 = table1_from_stats([Artifact(artifact_url(name)).manifest().stats
                                for name in ("tier12_captions", "adv_captions")])
    if table1 is None:  # tier shards written before their counts were kept
        texts = Artifact(artifact_url("largefine")).rows(["tier", "text"])
        table1 = corpus_statistics({tier: [r["text"] for r in texts if r["tier"] == tier] for tier in TIERS})
    manifests = {name: Artifact(artifact_url(name)).manifest().stats for name in
                 ("images", "accepted", "neighbours", "tier12_captions", "adv_captions", "largefine")}
    per_source: dict[str, Counter[str]] = defaultdict(Counter)
    for _, t in Artifact(artifact_url("images")).iter_shards(["source"]):
        for s in t.column("source").to_pylist():
            per_source[_source_name(s)]["ingested"] += 1
    for _, t in Artifact(artifact_url("accepted")).iter_shards(["source"]):
        for s in t.column("source").to_pylist():
            per_source[_source_name(s)]["denoised"] += 1
    for r in captions:
        per_source[_source_name(r["source"])]["texts"] += 1
    return {"table1": table1, "multi_granularity": _tiers_with_texts(table1) > 1, "stages": manifests,
            "per_source": {k: dict(v) for k, v in per_source.items()},
            "generators": dict(Counter(r["generator"] for r in captions))}


def card_markdown(stats: dict[str, Any], profile_name: str, *, webdataset: bool) -> str:
    """The card's text from its numbers (``card_stats``, or a ``card.json`` read back)."""
    table1, per_source = stats["table1"], stats["per_source"]
    tiers_with_texts = _tiers_with_texts(table1)
    multi = tiers_with_texts > 1
    lines = [f"# LargeFine-style person captions ({profile_name} profile)", "",
             "One row per (image, tier) in `largefine/`: `tier` is base (Q&A), inter (hard-negative comparison) or "
             "adv (stylized template); `text` is the cleaned training text, `raw_text` the generator's output and "
             "`cleaning` what was removed (hard-negative mentions, boilerplate, repeated sentences); `q_txt` is the "
             "mean token probability (GTR+ Eq. 8).", "",
             *loading_snippet(CARD_TABLES, default="largefine"), "",
             *([*WDS_SNIPPET, ""] if webdataset else []),
             "| texts | #texts | #words/text | #adj./text | #noun chunks/text |", "|---|---|---|---|---|"]
    for name, s in table1.items():
        lines.append(f"| {name} | {s['texts']} | {s['words_per_text']:.2f} | {s['adjectives_per_text']:.2f} | "
                     f"{s['noun_chunks_per_text']:.2f} |")
    lines += ["", f"Multi-granularity: {'yes' if multi else 'no'} (texts of {tiers_with_texts} tiers of detail).",
              "", "| source | ingested | after denoise | texts |", "|---|---|---|---|"]
    for source, c in sorted(per_source.items()):
        lines.append(f"| {source} | {c.get('ingested', 0)} | {c.get('denoised', 0)} | {c.get('texts', 0)} |")
    lines += ["", "Rejected texts with reasons: `caption_rejects`; rejected images: `ingest_rejects`, "
              "`denoise_rejects`, `select_rejects`. Lineage: `_manifest.json` in each folder."]
    return "\n".join(lines)


def _tiers_with_texts(table1: dict[str, dict[str, Any]]) -> int:
    """How many tiers of detail have texts (the card's multi-granularity: more than one)."""
    return sum(1 for tier in TIERS if table1.get(tier, {}).get("texts"))


def _source_name(source: str) -> str:
    """The dataset a row came from: ``pool:vtest.avi:crop:00012`` → ``pool:vtest.avi``; a path → its folder."""
    if source.startswith("pool:"):
        return ":".join(source.split(":")[:2])
    return str(Path(source).parent)


def throughput_rows(results: Sequence[Any]) -> list[dict[str, Any]]:
    """Retention and throughput per captioning stage: images/s and tokens/s over the stage's wall
    time (shards run concurrently, so summed per-shard generator time would double count).
    ``results``: the stages' ``StageResult``s."""
    rows = []
    for result in results:
        stats = result.stats
        images, tokens = int(stats.get("images", 0)), int(stats.get("generated_tokens", 0))
        wall = result.seconds
        rows.append({"stage": result.stage, "input": result.input_rows, "accepted": result.accepted,
                     "retention": round(result.accepted / result.input_rows, 4) if result.input_rows else 0.0,
                     "images": images, "generator_calls": int(stats.get("generator_calls", 0)), "tokens": tokens,
                     "images_per_s": round(images / wall, 3) if wall and not result.skipped else None,
                     "tokens_per_s": round(tokens / wall, 1) if wall and not result.skipped else None,
                     "generator_seconds": float(stats.get("generator_seconds", 0.0)),
                     "stage_seconds": round(wall, 1), "skipped": result.skipped})
    return rows

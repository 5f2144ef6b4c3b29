"""Opens every artifact folder under an output root the way the documentation tells users to
(docs/architecture.md, "Artifacts"):
``pd.read_parquet(folder)``, ``pyarrow.dataset.dataset(folder)`` and ``datasets.load_dataset``
with the documented ``data_files="<folder>/*.parquet"`` pattern (``data_dir=`` would also pick up
``_manifest.json``: Hugging Face skips only dot-files)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.dataset as pads

from storage import Artifact


def artifact_folders(root: str | Path) -> list[Path]:
    """Every artifact folder (one with a manifest) under ``root``, at any depth."""
    return sorted(m.parent for m in Path(root).rglob("_manifest.json"))


def assert_every_artifact_opens(root: str | Path, hf_cache: str | Path) -> list[Path]:
    """Read each artifact with pandas, pyarrow and datasets; each must give the manifest's row
    count. Returns the folders checked (so a caller can assert it found what it built)."""
    from datasets import load_dataset

    folders = artifact_folders(root)
    assert folders, f"no artifacts under {root}"
    failures: list[str] = []
    for folder in folders:
        rows = Artifact(str(folder)).count_rows()
        try:
            assert len(pd.read_parquet(folder)) == rows, "pandas row count"
            assert pads.dataset(str(folder), format="parquet").count_rows() == rows, "pyarrow row count"
            if rows:  # datasets cannot infer features from zero-row shards alone: nothing to load
                ds = load_dataset("parquet", data_files=str(folder / "*.parquet"), split="train",
                                  cache_dir=str(hf_cache))
                assert ds.num_rows == rows, "datasets row count"
        except Exception as exc:  # collect all, so one run names every unreadable folder
            failures.append(f"{folder.relative_to(root)}: {type(exc).__name__}: {str(exc)[:300]}")
    assert not failures, "artifact folders that the standard readers cannot open:\n" + "\n".join(failures)
    return folders


def run_card_snippet(card_folder: str | Path, copy_to: Path, hf_cache: Path) -> dict[str, Any]:
    """Copy a dataset card's folder elsewhere (a user moving the dataset) and run the card's own
    Python block there, as it is written, with the copy as the working directory and the original
    folder renamed away (so a path into it would fail); returns the names the block defined."""
    import datasets.config

    source = Path(card_folder)
    shutil.copytree(source, copy_to)
    code = (copy_to / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    hidden = source.with_name(source.name + ".moved-away")
    source.rename(hidden)
    cwd, cache = os.getcwd(), datasets.config.HF_DATASETS_CACHE
    names: dict[str, Any] = {}
    try:
        os.chdir(copy_to)
        datasets.config.HF_DATASETS_CACHE = hf_cache
        exec(compile(code, str(copy_to / "README.md"), "exec"), names)  # the card's own snippet, as written
    finally:
        os.chdir(cwd)
        datasets.config.HF_DATASETS_CACHE = cache
        hidden.rename(source)
    return names

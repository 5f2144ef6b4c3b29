"""The parts of a dataset card that say how to load it, written so that they stay true wherever the
folder goes: a copy on another machine, an ``s3://`` prefix, a Hugging Face Hub repository.

A card sits at the top of its folder (the Hub's layout: ``README.md`` at the root, Parquet in
subfolders). Its YAML header lists one ``configs`` entry per table, with ``data_files`` relative
to the card, which is what ``datasets.load_dataset(<folder or repo id>, <config>)`` reads; its
Python snippet names every table relative to a single ``here`` (the card's folder: ``"."`` when
run there), never an absolute path of the machine that built it.
"""

from __future__ import annotations

from collections.abc import Sequence


def configs_header(tables: Sequence[str], default: str | None = None) -> str:
    """The card's YAML front matter: one config per table folder (``<table>/*.parquet``); the
    ``default`` table, when given, is the one ``load_dataset(folder)`` reads without a config."""
    lines = ["---", "configs:"]
    for table in tables:
        lines.append(f"- config_name: {'default' if table == default else table}")
        lines.append(f"  data_files: {table}/*.parquet")
    return "\n".join([*lines, "---", "", ""])


def loading_snippet(tables: Sequence[str], default: str | None = None) -> list[str]:
    """A fenced Python block that loads every table with pandas, relative to the card's folder,
    and one (the ``default``, or the first) with ``datasets``: its Parquet files under the same
    folder, or, uploaded to the Hub, by the card's configs."""
    first = default or tables[0]
    config = "" if first == default else f', "{first}"'
    return ["```python", "import pandas as pd", "from datasets import load_dataset", "",
            'here = "."  # the folder of this card: a copy of it, s3://bucket/prefix/..., or a mounted bucket',
            *[f'{_name(t)} = pd.read_parquet(f"{{here}}/{t}")' for t in tables],
            f'{_name(first)}_ds = load_dataset("parquet", data_files=f"{{here}}/{first}/*.parquet", split="train")',
            f'# on the Hub, by this card\'s configs: load_dataset("<user>/<repo>"{config}, split="train")', "```"]


def card_folder_note(folder: str) -> str:
    """The line a card's copy in the Prefect UI starts with: which folder its ``here`` is."""
    return f"The card's folder (`here` in its snippet): `{folder}`\n\n"


def _name(table: str) -> str:
    return table.replace("-", "_")

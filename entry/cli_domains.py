"""``rde domain``: start a new domain file (``new``) and see what a domain declares (``show``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from entry.cli_base import _fail, app, console

domain_app = typer.Typer(help="Domains: the subject, regions, motion and texts of a benchmark, one YAML "
                         "file each (bundled ones in domains/).", no_args_is_help=True)
app.add_typer(domain_app, name="domain")


def domain_ref(domain) -> str:
    """How a profile names the domain: a bundled one by name, a user's by its file."""
    from models.domains import DOMAIN_DIR

    return domain.name if Path(domain.source).parent == DOMAIN_DIR else domain.source


def domains_table(domains, title: str) -> Table:
    """One row per domain: its file, detector classes, measured slots and motion states."""
    table = Table(title=title)
    for col in ("domain", "file", "classes", "slots", "motion"):
        table.add_column(col)
    for d in domains:
        table.add_row(d.name, escape(domain_ref(d)), ", ".join(d.subject.classes),
                      ", ".join(slot for slot, _ in d.slot_kinds()), ", ".join(m.name for m in d.motion))
    return table


@domain_app.command("new")
def domain_new(
    name: Annotated[str, typer.Argument(help="The new domain's name (lower case, digits, underscores).")],
    like: Annotated[str | None, typer.Option(help="Start from this domain (a bundled name or a YAML path) "
                                                  "instead of the minimal template.")] = None,
    cls: Annotated[str | None, typer.Option("--class", help="The detector class of the subject (minimal "
                                                            "template; default: the name).")] = None,
    folder: Annotated[Path | None, typer.Option(help="Where to write the domain file (default: the bundled "
                                                     "domains/ folder).")] = None,
    prompts: Annotated[Path | None, typer.Option(help="Where to write its DAP prompt file (default: the "
                                                      "bundled prompts/ folder).")] = None,
) -> None:
    """Write a commented domain file and its DAP prompt file to start from; then edit them and add the
    domain to a profile's `domains:` list."""
    from entry.domain_files import DomainFileError, write_domain
    from models.domains import DomainError

    try:
        domain_path, prompt_path = write_domain(name, like=like, cls=cls, folder=folder, prompts=prompts)
    except (DomainFileError, DomainError) as exc:
        _fail(str(exc))
    console.print(f"[green]wrote[/] {escape(str(domain_path))}\n[green]wrote[/] {escape(str(prompt_path))}")
    console.print(f"next: edit them, add `{name}` to a profile's `domains:` list, then "
                  "`rde profile show <profile>` checks it")


@domain_app.command("show")
def domain_show(ref: Annotated[str, typer.Argument(help="A bundled domain's name or a domain YAML path.")]) -> None:
    """Validate one domain file and print it with every default filled in."""
    import yaml

    from models.domains import DomainError, load_domain

    try:
        domain = load_domain(ref)
    except DomainError as exc:
        _fail(str(exc))
    console.print(domains_table([domain], f"domain {domain.name}"))
    console.print(escape(yaml.safe_dump(domain.model_dump(mode="json", exclude_none=True), sort_keys=False)))

"""``rde``: the engine's command line. One subcommand per flow (``cli_flows``), plus profile,
data, model and artifact tools (``cli_tools``), domain files (``cli_domains``) and the local stack
(``cli_stack``); what they share is in ``cli_base``."""

from __future__ import annotations

import sys

from entry import cli_domains, cli_evaluate, cli_flows, cli_stack, cli_tools, describe  # noqa: F401  (each registers its commands on the app)
from entry.cli_base import app, console, print_ranked, print_summary
from entry.cli_flows import FlowRef, _guess_kind

__all__ = ["FlowRef", "_guess_kind", "app", "console", "main", "print_ranked", "print_summary"]


def main() -> None:  # pragma: no cover
    app(prog_name="rde")


if __name__ == "__main__":  # pragma: no cover (`python -m entry.cli stack up`)
    sys.exit(main())

"""A domain's DAP prompt: the prompt file its ``queries.prompt`` names, with the domain's subject
(``{subject}``) and few-shot examples (``{examples}``, one per line) written into its templates, and
the domain's ``subject.nouns`` as the words a query must use (``domain_words``).

A bundled domain's prompt (``dap_pedestrian``) holds its text whole; a new domain can use the
generic one (``dap_generic``: the paper's Table 11 structure with the subject and the examples left
open) and declare only its subject and examples. The identity of the result hashes the file and
what was written into it, so editing either re-runs DAP.
"""

from __future__ import annotations

from models.domains import Domain
from models.prompt_files import PromptFile, load_prompt
from storage.hashing import sha256_json


def _braces(text: str) -> str:
    """``text`` safe inside a template that is later ``str.format``-ed."""
    return text.replace("{", "{{").replace("}", "}}")


def dap_prompt(domain: Domain) -> PromptFile:
    """The DAP prompt of ``domain`` (see the module docstring)."""
    base = load_prompt(domain.queries.prompt)
    fills = {"{subject}": _braces(domain.queries.subject), "{examples}": _braces("\n".join(domain.queries.examples))}
    templates = {}
    for name, text in base.templates.items():
        for key, value in fills.items():
            text = text.replace(key, value)
        templates[name] = text
    extras = {**base.extras, "domain_words": list(domain.subject.nouns)}
    digest = sha256_json([base.sha256, domain.queries.model_dump(mode="json"), domain.subject.nouns])
    return PromptFile(base.name, base.version, digest, templates, extras)

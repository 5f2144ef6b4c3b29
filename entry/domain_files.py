"""``rde domain new``: a commented domain file and a DAP prompt file to start a new domain from.

Without ``--like``, the domain is the smallest one that runs every stage: one class, two colour
regions (the upper and lower part of the box), still/moving motion, captions, questions and a
comparison about its colour, the generic DAP prompt's structure. With ``--like NAME``, the bundled
(or given) domain's file is copied with its comments, renamed, and its slots and facts prefixed
with the new name, so both can sit in one profile (two domains may not declare the same slot); its
detector classes must still be changed to ones no other domain of the profile claims.
"""

from __future__ import annotations

import re
from pathlib import Path

from models.domains import DOMAIN_DIR, domain_file, load_domain
from models.prompt_files import prompt_dir

TEMPLATE = '''# {name}: what the domain is, in a sentence. Every field: docs/adding-a-domain.md.
# Add it to a profile's `domains:` list (by name when this file is in domains/, else by path) and
# check it with `rde profile show <profile>`.
name: {name}
description: {plural} seen by a surveillance camera, described by their colour and motion.
subject:
  # the detector's class names (the bundled SSD-MobileNet knows the COCO classes; with detector
  # backend owl any text works: open_vocabulary gives the text it looks for, one per class)
  classes: [{cls}]
  noun: {noun}                   # the fact line "subject: a {noun}"
  said_as: the {noun}            # {{subject}} in the Q&A answers
  nouns: [{noun}]                # a generated query must use one of these
  mentions: [{noun}]             # words that tell a text is about this domain
  size: {{min_width: 32, min_height: 32}}   # smaller crops are too_small
regions:                         # bands of the box whose colour is measured (shares of its height)
  - slot: {name}_colour
    fact: {name}_colour
    band: [0.2, 0.6]
    line: {noun} colour
    words: [{noun}]              # a colour next to one of these words in a text is this region's
  - slot: {name}_lower_colour
    fact: {name}_lower_colour
    band: [0.6, 0.95]
    line: colour of the {noun}'s lower part
motion:                          # speeds in box heights per second over the track's last second
  - {{name: stationary, below: 0.03, says: [stationary, still]}}
  - {{name: moving, at_least: 0.1, says: [move, moves, moving]}}
queries:
  prompt: dap_{name}             # prompts/dap_{name}.yaml, written beside this file
  subject: {noun}s
  examples:                      # three queries as a user would type them (also: never echoed)
    - A gray {noun} moving to the left.
    - A white {noun} that is stationary.
    - A black {noun} far from the camera.
captions:
  request: Describe the {noun} in the image in one or two sentences.
  attributes: [colour, size, shape, markings, motion]   # what a describer model's tier Q&A asks about
  from_facts:                    # sentences said from the measured values ([a|b]: optional, first that fits)
    {name}:
      - "A[ {{{name}_colour}}] {noun} is {{motion}}[ {{direction}}]."
      - The {noun} is {{{name}_colour}}.
    distance: The {noun} is {{value}}.
questions:                       # Q&A the tiers ask about each measured fact (a tier needs two pairs)
  {name}_colour: {{q: "What colour is the {noun}?", a: "The {noun} is {{value}}."}}
  {name}_lower_colour: {{q: "What colour is the lower part of the {noun}?", a: "Its lower part is {{value}}."}}
comparisons:                     # the intermediate tier's Q&A, comparing the image with a similar one
  {name}_colour:
    similar_q: "What is similar about the two {noun}s?"
    similar_a: "The {noun} in Target-Image is {{value}}, like the one in Compare-Image."
    differ_q: "How do the two {noun}s differ?"
    differ_a: "The {noun} in Target-Image is {{target}}, unlike the {{reference}} {noun} in Compare-Image."
'''


class DomainFileError(ValueError):
    """The domain file cannot be written; the message says why."""


def _prefixed(text: str, name: str, like: str) -> str:
    """The ``like`` domain's file text for ``name``: renamed, its slots and facts (and the
    placeholders and Q&A keys that name its facts) prefixed, its prompt the new one."""
    spec = load_domain(like)
    text = re.sub(r"^name: .*$", f"name: {name}", text, count=1, flags=re.M)
    facts = [f for f in ([spec.subject.types.fact] if spec.subject.types else [])]
    facts += [r.fact for r in spec.regions] + [h.fact for h in (spec.carried, spec.ridden) if h]
    slots = [s for s, _ in spec.slot_kinds()]
    for word in sorted(set(facts) | set(slots), key=len, reverse=True):
        text = re.sub(rf"(slot|fact): {word}\b", rf"\1: {name}_{word}", text)
        text = re.sub(rf"\{{{word}\}}", f"{{{name}_{word}}}", text)
        text = re.sub(rf"^(  ){word}:", rf"\1{name}_{word}:", text, flags=re.M)
        text = re.sub(rf"unless: \[([^\]]*)\b{word}\b", rf"unless: [\1{name}_{word}", text)
    text = re.sub(r"^  prompt: .*$", f"  prompt: dap_{name}", text, flags=re.M)
    note = (f"# Started from the {like} domain (`rde domain new {name} --like {like}`): change subject.classes to "
            "classes no other domain of your profile claims, and the nouns and wording to your subject.\n")
    return note + text


def write_domain(name: str, like: str | None = None, cls: str | None = None, folder: Path | None = None,
                 prompts: Path | None = None) -> tuple[Path, Path]:
    """Write ``<folder>/<name>.yaml`` (default ``domains/``) and ``<prompts>/dap_<name>.yaml``
    (default ``prompts/``); refuse to overwrite either. Returns both paths."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise DomainFileError(f"domain name {name!r}: lower case letters, digits and underscores, starting with a "
                              "letter")
    target = (folder or DOMAIN_DIR) / f"{name}.yaml"
    prompt_target = (prompts or prompt_dir()) / f"dap_{name}.yaml"
    for path in (target, prompt_target):
        if path.exists():
            raise DomainFileError(f"{path} exists: choose another name or remove it")
    if like is not None:
        source = domain_file(like)
        if not source.is_file():
            raise DomainFileError(f"--like {like}: no domain file {source}")
        text = _prefixed(source.read_text(encoding="utf-8"), name, like)
        base_prompt = prompt_dir() / f"{load_domain(like).queries.prompt}.yaml"
    else:
        noun = name.replace("_", " ")
        text = TEMPLATE.format(name=name, noun=noun, cls=cls or noun, plural=f"{noun}s".capitalize())
        base_prompt = prompt_dir() / "dap_generic.yaml"
    if prompt_target.parent.resolve() != prompt_dir().resolve():  # outside prompts/: named by its path
        text = re.sub(r"^  prompt: .*$", f"  prompt: {prompt_target.resolve()}", text, count=1, flags=re.M)
    prompt_text = re.sub(r"^name: .*$", f"name: dap_{name}", base_prompt.read_text(encoding="utf-8"), count=1,
                         flags=re.M)
    prompt_text = f"# The DAP prompt of the {name} domain, started from {base_prompt.name}.\n" + prompt_text
    target.parent.mkdir(parents=True, exist_ok=True)
    prompt_target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    prompt_target.write_text(prompt_text, encoding="utf-8")
    return target, prompt_target

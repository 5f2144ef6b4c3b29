"""Domains as data: domain files load and validate with one-line errors naming the file and the field;
a profile checks its domains together (unique classes, classes the detector knows); ``rde domain new``
writes files that load; and no module outside the domain files names a bundled domain as logic."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from entry.cli import app
from models.backends.slot_layout import slot_layout
from models.domains import DOMAIN_DIR, DomainError, load_domain, load_domains
from rde.profile import PROFILE_DIR, ProfileError, parse_profile

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {"name": "kite", "subject": {"classes": ["kite"], "noun": "kite", "said_as": "the kite", "nouns": ["kite"]},
           "queries": {"prompt": "dap_generic"}, "captions": {"request": "Describe the kite."}}


def _write(tmp_path: Path, data: dict, name: str = "kite.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _demo_with(*extra: str) -> dict:
    data = yaml.safe_load((PROFILE_DIR / "demo.yaml").read_text())
    data["domains"] = [*data["domains"], *extra]
    return data


def test_bundled_domains_load_and_declare_what_the_models_read() -> None:
    ped, veh = load_domain("pedestrian"), load_domain("vehicle")
    assert ped.subject.classes == ["person"] and "bus" in veh.subject.classes
    assert [s for s, _ in ped.slot_kinds()][:2] == ["upper", "lower"]
    assert veh.subject.types is not None and veh.subject.types.slot == "vehicle_type"
    assert [m.name for m in ped.motion] == ["standing", "walking", "running"]
    # the thresholds: below 0.06 standing, 0.06..0.15 unsaid, 0.15..1.6 walking, 1.6 up running
    assert [getattr(ped.state(v), "name", None) for v in (0.0, 0.1, 0.15, 1.59, 1.6)] == \
        [None if v == 0.1 else n for v, n in ((0.0, "standing"), (0.1, None), (0.15, "walking"),
                                              (1.59, "walking"), (1.6, "running"))]
    assert veh.state(0.02).name == "parked" and veh.state(0.2).name == "moving"
    assert Path(ped.source) == DOMAIN_DIR / "pedestrian.yaml"


def test_a_domain_file_with_an_unknown_key_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, {**MINIMAL, "subject": {**MINIMAL["subject"], "colour": "red"}})
    with pytest.raises(DomainError) as err:
        load_domain(str(path))
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "subject.colour" in message


def test_a_missing_required_field_is_named(tmp_path: Path) -> None:
    data = {k: v for k, v in MINIMAL.items() if k != "captions"}
    path = _write(tmp_path, data)
    with pytest.raises(DomainError, match=r"kite\.yaml: captions: Field required"):
        load_domain(str(path))
    nouns = {**MINIMAL, "subject": {k: v for k, v in MINIMAL["subject"].items() if k != "nouns"}}
    with pytest.raises(DomainError, match=r"subject\.nouns: Field required"):
        load_domain(str(_write(tmp_path, nouns, "k2.yaml")))


def test_a_missing_file_and_a_bad_motion_state_say_so(tmp_path: Path) -> None:
    with pytest.raises(DomainError, match=r"no file .*bundled domains: cyclist, pedestrian, vehicle"):
        load_domain("forklift")
    bad = {**MINIMAL, "motion": [{"name": "still", "below": 0.1, "at_least": 0.2, "says": ["still"]}]}
    with pytest.raises(DomainError, match=r"motion\.0: .*exactly one of below and at_least"):
        load_domain(str(_write(tmp_path, bad)))


def test_a_class_the_detector_does_not_know_fails_the_profile_naming_the_domain_file(tmp_path: Path) -> None:
    path = _write(tmp_path, {**MINIMAL, "subject": {**MINIMAL["subject"], "classes": ["forklift"]}})
    with pytest.raises(ProfileError) as err:
        parse_profile(_demo_with(str(path)), "demo.yaml")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "subject.classes" in message and "forklift" in message
    # an open-vocabulary detector knows any class: it is told every domain's text names
    data = _demo_with(str(path))
    data["models"]["detector"] = {"backend": "owl", "model_id": "google/owlv2-base-patch16-ensemble"}
    detector = parse_profile(data, "demo.yaml").models.detector
    assert "forklift" in detector.classes and "person" in detector.classes
    assert len(detector.prompts) == len(detector.classes)


def test_two_domains_claiming_one_class_fail(tmp_path: Path) -> None:
    path = _write(tmp_path, {**MINIMAL, "name": "cars_too", "subject": {**MINIMAL["subject"], "classes": ["car"]}})
    with pytest.raises(ProfileError) as err:
        parse_profile(_demo_with(str(path)), "demo.yaml")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "subject.classes" in message
    assert "domains 'vehicle' and 'cars_too' both claim the detector class 'car'" in message


def test_two_domains_declaring_one_slot_fail() -> None:
    with pytest.raises(DomainError, match="slot"):
        load_domains(["pedestrian", {**yaml.safe_load((DOMAIN_DIR / "pedestrian.yaml").read_text()),
                                     "name": "walkers", "subject": {**MINIMAL["subject"], "classes": ["dog"]}}])


def test_a_third_domain_extends_the_attribute_layout_without_code() -> None:
    kite = load_domain(MINIMAL | {"regions": [{"slot": "kite_colour", "fact": "kite_colour", "band": [0.1, 0.9],
                                                "line": "kite colour"}]})
    layout = slot_layout(load_domains(["pedestrian", "vehicle", kite]))
    assert layout.slots["domain"] == ["pedestrian", "vehicle", "kite"] and layout.kinds["kite_colour"] == "colour"
    assert "kite" in layout.mentions["kite"] or layout.mentions["kite"] == set()


@pytest.mark.parametrize("like", [None, "pedestrian", "vehicle"])
def test_domain_new_writes_files_that_load_beside_the_bundled_ones(tmp_path: Path, like: str | None) -> None:
    start = ["--like", like] if like else ["--class", "dog"]
    result = CliRunner().invoke(app, ["domain", "new", "forklift", "--folder", str(tmp_path / "d"),
                                      "--prompts", str(tmp_path / "p"), *start])
    assert result.exit_code == 0, result.output
    path = tmp_path / "d" / "forklift.yaml"
    text = path.read_text()
    assert text.startswith("#") and (tmp_path / "p" / "dap_forklift.yaml").is_file()
    domain = load_domain(str(path))
    assert domain.name == "forklift" and domain.queries.prompt == str((tmp_path / "p" / "dap_forklift.yaml").resolve())
    from rde.secmm.dap_prompts import dap_prompt

    assert dap_prompt(domain).name == "dap_forklift"  # the prompt written beside it is the one it loads
    if like:  # its classes are the copied domain's: the profile says which domain already claims them
        with pytest.raises(ProfileError, match="both claim the detector class"):
            parse_profile(_demo_with(str(path)), "demo.yaml")
        domain = load_domain(str(path)).model_copy(update={"subject": domain.subject.model_copy(
            update={"classes": ["dog"], "open_vocabulary": [], "types": None})})
        domain._source = str(path)
    profile = parse_profile(_demo_with(str(path)) if not like else {**_demo_with(), "domains": [
        "pedestrian", "vehicle", domain.model_dump()]}, "demo.yaml")
    assert [d.name for d in profile.domain_set] == ["pedestrian", "vehicle", "forklift"]
    again = CliRunner().invoke(app, ["domain", "new", "forklift", "--folder", str(tmp_path / "d"),
                                     "--prompts", str(tmp_path / "p")])
    assert again.exit_code == 2 and "exists" in again.output


def test_profile_show_lists_the_domains_with_their_classes() -> None:
    result = CliRunner().invoke(app, ["profile", "show", "demo"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.strip().startswith(("│ pedestrian", "│ vehicle"))]
    assert any("person" in r for r in rows) and any("car, bus" in r for r in rows)
    shown = CliRunner().invoke(app, ["domain", "show", "vehicle"])
    assert shown.exit_code == 0 and "vehicle_type" in shown.output


# ---- no domain names as logic -------------------------------------------------------------------

CODE_PACKAGES = ("rde", "models", "tasks", "flows", "storage")
NAMES = ("pedestrian", "vehicle")
PROSE_KEYWORDS = {"description", "help"}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _prose_nodes(tree: ast.AST) -> set[int]:
    """String constants that are prose: a keyword argument ``description=``/``help=`` (field and
    option documentation), whole or in parts."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in PROSE_KEYWORDS:
            out |= {id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant)}
    return out


def domain_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string constant naming a bundled domain that is neither a docstring nor
    prose (comments are not in the tree)."""
    tree = ast.parse(source)
    skip = _docstring_nodes(tree) | _prose_nodes(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
            and any(name in n.value.lower() for name in NAMES)]


def test_the_literal_check_finds_a_domain_name_used_as_logic() -> None:
    logic = 'def f(d):\n    """For the pedestrian domain."""\n    return d == "pedestrian"  # vehicle\n'
    assert domain_literals(logic) == [(3, "pedestrian")]
    assert domain_literals('x = Field(1, description="a vehicle")\n') == []
    assert domain_literals('WORDS = {"vehicle": 1}\n') == [(1, "vehicle")]


def test_no_module_names_a_bundled_domain_as_logic() -> None:
    found = []
    for package in CODE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}: {text!r}"
                      for line, text in domain_literals(path.read_text(encoding="utf-8"))]
    assert found == []


def test_a_domain_with_templates_gives_the_gallery_its_slots_seeds_and_subject() -> None:
    """The cyclist domain's templates replace the gallery prompt's (written for people): its seeds
    pass the gallery's checks with its subject slot as the topic, a person-shaped template is
    refused for a slot the domain does not have; the pedestrian domain keeps the prompt file."""
    from models.backends.interfaces import GenerationResult
    from models.prompt_files import load_prompt
    from rde.largefine.template_gallery import build_gallery, validate_template
    from tasks.largefine.template_gallery import domain_gallery_prompt

    base = load_prompt("gtr_template_gallery")
    assert domain_gallery_prompt(base, [load_domain("pedestrian")]) is base
    cyclist = load_domain("cyclist")
    prompt = domain_gallery_prompt(base, [cyclist])
    assert prompt.extras["slots"] == cyclist.templates.slots and prompt.identity != base.identity
    assert prompt.extras["caption_pattern"]["person_slot"] == "cyclist"

    def nothing(requests):  # no generator: the gallery is its seeds
        return [GenerationResult(r.request_id, "", [], "none", "error", "no generator", 1) for r in requests]

    gallery = build_gallery(nothing, [], prompt, captions_per_request=4, rounds=0, max_templates=50, min_words=6,
                            max_words=40, max_tokens=10, temperature=0.7, seed=0,
                            measurable_slots=prompt.extras["measurable_slots"])
    assert [t.text for t in gallery.templates] == cyclist.templates.seeds
    reason = validate_template("The [person/man/woman] wears [top description] today.", prompt.extras["slots"], 6, 40)
    assert reason is not None and reason[0] == "unknown_slot"

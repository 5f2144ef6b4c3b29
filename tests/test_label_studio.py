"""A real Label Studio round trip: a local server (the ``label-studio`` package in its own
environment, named by ``RDE_LABEL_STUDIO_PYTHON``; ``scripts/label_studio_check.sh`` builds it and CI
runs it after ``make test``), on loopback with a temporary data folder.

The demo's benchmark is built; ``scripts/label_studio_project.py`` creates a project from its review
folder (the grid config, the per-query tasks, the images through local-files serving); every task
is annotated through label-studio-sdk; the project is exported and ``rde labels import``-ed; the
qrels and the evaluation then say what the annotations said.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from browser import chromium_driver
from s3_server import free_port
from server_process import serving
from typer.testing import CliRunner

from entry.cli import app
from flows.build_secmm import build_secmm
from storage import Artifact

pytestmark = [pytest.mark.label_studio,
              pytest.mark.skipif(not os.environ.get("RDE_LABEL_STUDIO_PYTHON"),
                                 reason="set RDE_LABEL_STUDIO_PYTHON (scripts/label_studio_check.sh)")]
ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300
TOKEN = "rde-test-token-0123456789"  # a legacy API token given to the first user at the server's start
USER, PASSWORD = "reviewer@example.com", "rde-test-password"
GENERATION = {"queries": {"caption_sample_per_domain": 16, "max_rounds": 3}}  # as tests/test_flow_build_secmm.py


def _ls_python() -> str:
    return os.environ["RDE_LABEL_STUDIO_PYTHON"]


@pytest.fixture(scope="module")
def label_studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's URL; its start time printed."""
    data = tmp_path_factory.mktemp("label-studio")
    port = free_port()
    env = {**os.environ, "LABEL_STUDIO_USERNAME": USER, "LABEL_STUDIO_PASSWORD": PASSWORD,
           "LABEL_STUDIO_USER_TOKEN": TOKEN, "LABEL_STUDIO_ENABLE_LEGACY_API_TOKEN": "true",
           "LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED": "true", "LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT": "/",
           "LATEST_VERSION_CHECK": "false", "SENTRY_DSN": "", "COLLECT_ANALYTICS": "false"}
    env.pop("PYTHONPATH", None)
    binary = str(Path(_ls_python()).with_name("label-studio"))
    url = f"http://127.0.0.1:{port}"
    with serving("Label Studio", [binary, "start", "--no-browser", "--internal-host", "127.0.0.1", "-p", str(port),
                                  "--data-dir", str(data / "data")], env, data / "server.log", f"{url}/health/",
                 START_TIMEOUT_S):
        yield url


def _run(*args: str) -> str:
    done = subprocess.run([_ls_python(), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _grid_images(url: str, project: str, marker: str, screenshot: Path) -> list[int]:
    """Log in to Label Studio in headless Chromium, open the project's first task, and return the
    natural widths of its grid's images (those whose URL holds ``marker``) once they have loaded."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    listed = httpx.get(f"{url}/api/tasks", params={"project": project, "page_size": 1},
                       headers={"Authorization": f"Token {TOKEN}"}, timeout=30).json()
    task = (listed["tasks"] if isinstance(listed, dict) else listed)[0]["id"]
    browser = chromium_driver()
    script = ("return Array.from(document.images).filter(i => i.src.includes(arguments[0]))"
              ".map(i => i.complete ? i.naturalWidth : 0)")
    try:
        browser.get(f"{url}/user/login/")
        browser.find_element(By.NAME, "email").send_keys(USER)
        browser.find_element(By.NAME, "password").send_keys(PASSWORD)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit], input[type=submit]").click()
        WebDriverWait(browser, 60).until(lambda b: "/user/login" not in b.current_url)
        browser.get(f"{url}/projects/{project}/data?task={task}")
        widths: list[int] = []

        def loaded(b) -> bool:
            widths[:] = b.execute_script(script, marker)
            return bool(widths) and all(w > 0 for w in widths)

        try:
            WebDriverWait(browser, 90, poll_frequency=0.5).until(loaded)
        finally:
            browser.save_screenshot(str(screenshot))
    finally:
        browser.quit()
    return widths


def test_label_studio_round_trip(label_studio: str, tmp_path: Path, test_artifacts_dir: Path) -> None:
    out = str(tmp_path / "run")
    arts = build_secmm(profile="demo", output_root=out, overrides=GENERATION)["artifacts"]
    bench = Path(out) / "build-secmm" / "demo" / "benchmark"
    review = bench / "review"
    candidates = Artifact(arts["candidates"]["url"]).to_pandas()
    created = _run("scripts/label_studio_project.py", "create", "--url", label_studio, "--token", TOKEN,
                   "--review", str(review), "--title", "demo review")
    project = created.split()[1].rstrip(":")
    tasks = json.loads((review / "label_studio_tasks.json").read_text())
    assert f"{len(tasks)} tasks imported" in created

    # the images reach the server: Label Studio serves a task's image from the review folder
    src = html.unescape(tasks[0]["data"]["candidates"][0]["html"].split('src="')[1].split('"')[0])
    got = httpx.get(label_studio + src, headers={"Authorization": f"Token {TOKEN}"}, timeout=30)
    assert got.status_code == 200 and got.content == (review / "images" / Path(src).name).read_bytes()

    # a reviewer marks, in every task, the candidates some expert ranked first
    firsts = candidates[candidates.best_rank == 1]
    marks = {q: sorted(g.image_id) for q, g in firsts.groupby("query_id")}
    (tmp_path / "marks.json").write_text(json.dumps(marks))
    annotated = json.loads(_run("tests/label_studio_annotate.py", label_studio, TOKEN, project,
                                str(tmp_path / "marks.json")))
    assert annotated == {"annotated": len(tasks)}
    export = tmp_path / "export.json"
    _run("scripts/label_studio_project.py", "export", "--url", label_studio, "--token", TOKEN,
         "--project", project, "--out", str(export))

    result = CliRunner().invoke(app, ["labels", "import", str(export), "--output", out, "--no-rebuild"])
    assert result.exit_code == 0, result.output
    assert f"imported {len(candidates)} decisions" in result.output
    build_secmm(profile="demo", output_root=out, overrides=GENERATION)
    qrels = Artifact(str(bench / "qrels")).to_pandas()
    assert qrels.verified.all() and len(qrels) == len(candidates)
    relevant = set(zip(qrels[qrels.relevant].query_id, qrels[qrels.relevant].image_id, strict=True))
    assert relevant == set(zip(firsts.query_id, firsts.image_id, strict=True))
    assert set(qrels.tool) == {"label-studio"} and set(qrels.annotator) == {USER}
    # the evaluation on those labels: every expert's first image is relevant, so its R@1 is 1
    evaluation = Artifact(arts["evaluation"]["url"]).to_pandas()
    built = evaluation[evaluation.benchmark == "build-secmm/demo"]
    assert set(built.labels) == {"verified"} and len(set(built.expert)) == 2
    assert (built[built.metric == "R@1"].value == 1.0).all()
    assert (built[built.metric == "mAP@10"].value < 1.0).any()  # the others' firsts are ranked lower

    # an annotator's browser shows the grid: the images through Label Studio's local files ...
    first_task = tasks[0]["data"]["candidates"]
    widths = _grid_images(label_studio, project, "/data/local-files/", test_artifacts_dir / "label_studio_task.png")
    assert len(widths) == len(first_task)
    # ... or, for a server on another machine, from wherever the images folder is published (here a
    # plain web server on loopback, set as review.label_studio_images)
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
                            str(review / "images")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        build_secmm(profile="demo", output_root=out,
                    overrides={**GENERATION, "review": {"label_studio_images": f"{base}/"}})
        remote_tasks = json.loads((review / "label_studio_tasks.json").read_text())
        assert f'src="{base}/' in remote_tasks[0]["data"]["candidates"][0]["html"]
        remote = _run("scripts/label_studio_project.py", "create", "--url", label_studio, "--token", TOKEN,
                      "--review", str(review), "--title", "published images").split()[1].rstrip(":")
        widths = _grid_images(label_studio, remote, base, test_artifacts_dir / "label_studio_task_published.png")
        assert len(widths) == len(remote_tasks[0]["data"]["candidates"])
    finally:
        web.terminate()
        web.wait(10)

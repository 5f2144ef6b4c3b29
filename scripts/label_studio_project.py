"""Send a benchmark's review to a Label Studio server, and bring the annotations back.

Runs with any Python that has ``label-studio-sdk`` (Label Studio's own environment has it); it
imports nothing of this project, so it needs none of its dependencies:

    python scripts/label_studio_project.py create --url http://ls:8080 --token T \\
        --review .rde/artifacts/.../benchmark/review
    python scripts/label_studio_project.py export --url http://ls:8080 --token T --project 3 \\
        --out annotations.json
    rde labels import annotations.json

``create`` makes a project with the review's ``label_config.xml`` (a query and a grid of its
candidates to mark as matches), imports ``label_studio_tasks.json`` in batches, and, when the tasks
show images through Label Studio's local-files serving (``/data/local-files/?d=...``), registers the
review's ``images/`` folder as the project's local storage, which Label Studio requires before it
serves a file. ``export`` writes the project's JSON export, every task with its annotations, which
``rde labels import`` reads, with each annotator's email. The token is a Label Studio access token (Account & Settings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BATCH = 500  # tasks per import request


def _client(url: str, token: str) -> LabelStudio:  # noqa: F821 - the SDK, imported inside
    try:
        from label_studio_sdk import LabelStudio
    except ImportError:
        sys.exit("label-studio-sdk is not installed in this Python: pip install label-studio-sdk")
    return LabelStudio(base_url=url, api_key=token)


def create(url: str, token: str, review: Path, title: str) -> int:
    """The project's id, after its tasks are imported."""
    tasks_file, config_file = review / "label_studio_tasks.json", review / "label_config.xml"
    for needed in (tasks_file, config_file):
        if not needed.is_file():
            sys.exit(f"{needed} not found: is {review} a benchmark's review folder?")
    tasks = json.loads(tasks_file.read_text(encoding="utf-8"))
    client = _client(url, token)
    project = client.projects.create(title=title, label_config=config_file.read_text(encoding="utf-8"))
    if any("/data/local-files/?d=" in c.get("html", "") for t in tasks[:1] for c in t["data"].get("candidates", [])):
        client.import_storage.local.create(project=project.id, path=str((review / "images").resolve()),
                                           title="review images", use_blob_urls=False)
    for start in range(0, len(tasks), BATCH):
        client.projects.import_tasks(project.id, request=tasks[start:start + BATCH])
    print(f"project {project.id}: {len(tasks)} tasks imported from {tasks_file}")
    return int(project.id)


def export(url: str, token: str, project: int, out: Path) -> int:
    """How many tasks the export holds. Label Studio's export names an annotation's author by user
    id; each one is completed with the user's email, so the decisions say who made them."""
    client = _client(url, token)
    data = client.projects.exports.as_json(project)
    emails = {user.id: user.email for user in client.users.list()}
    for task in data:
        for annotation in task.get("annotations", []):
            who = annotation.get("completed_by")
            if isinstance(who, int) and emails.get(who):
                annotation["completed_by"] = {"id": who, "email": emails[who]}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(out)
    done = sum(1 for t in data if t.get("annotations"))
    print(f"project {project}: {len(data)} tasks, {done} annotated → {out}")
    return len(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("create", "export"):
        p = sub.add_parser(name)
        p.add_argument("--url", required=True, help="the Label Studio server, e.g. http://localhost:8080")
        p.add_argument("--token", required=True, help="a Label Studio access token")
    sub.choices["create"].add_argument("--review", type=Path, required=True, help="the benchmark's review folder")
    sub.choices["create"].add_argument("--title", default="rde review", help="the project's title")
    sub.choices["export"].add_argument("--project", type=int, required=True, help="the project's id")
    sub.choices["export"].add_argument("--out", type=Path, required=True, help="where to write the JSON export")
    args = parser.parse_args(argv)
    if args.command == "create":
        create(args.url, args.token, args.review, args.title)
    else:
        export(args.url, args.token, args.project, args.out)


if __name__ == "__main__":
    main()

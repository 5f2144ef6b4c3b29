"""Annotates every task of a Label Studio project through label-studio-sdk, as a person would
submit them: in each task, the candidates named in a JSON file ({query_id: [image ids]}) are
marked as matches. Run by the Label Studio environment's Python (tests/test_label_studio.py)."""

import json
import sys

if __name__ == "__main__":
    from label_studio_sdk import LabelStudio

    url, token, project, marks_file = sys.argv[1:5]
    with open(marks_file, encoding="utf-8") as f:
        marks = json.load(f)
    client = LabelStudio(base_url=url, api_key=token)
    done = 0
    for task in client.tasks.list(project=int(project)):
        shown = [c["value"] for c in task.data["candidates"]]
        chosen = [image for image in shown if image in set(marks.get(task.data["query_id"], []))]
        client.annotations.create(id=task.id, result=[{"from_name": "matches", "to_name": "query", "type": "choices",
                                                       "value": {"choices": chosen}}])
        done += 1
    print(json.dumps({"annotated": done}))

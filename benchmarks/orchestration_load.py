"""Orchestration under load: many concurrent flow runs on a local stack, SQLite vs PostgreSQL.

For each database (back to back, each on a fresh stack of its own in a temporary folder: server,
one ``cpu`` worker, ``prefect.yaml`` deployed), submit 2, 8 and 16 concurrent runs of the
``stack-probe/probe`` deployment (each maps ``--shards`` tasks and publishes a table artifact)
and report runs completed / failed, task runs per second, p50/p95 seconds from submission to
start, the server's peak RSS, and the database errors the server log gained.

    .venv/bin/python benchmarks/orchestration_load.py [--levels 2 8 16] [--shards 50] [--work-ms 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from entry.orchestration_load import submit_and_wait
from entry.stack import StackConfig, down, free_port, up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--shards", type=int, default=50)
    parser.add_argument("--work-ms", type=int, default=20)
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgres"])
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per level")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    base = Path(tempfile.mkdtemp(prefix="rde-load-"))
    base.chmod(0o755)  # the postgres OS user must reach its cluster folder
    for database in args.databases:
        cfg = StackConfig(port=free_port(), folder=base / database, postgres=database == "postgres")
        up(cfg)
        try:
            for level in args.levels:
                result = submit_and_wait(cfg, level, args.shards, args.work_ms, args.timeout, f"{database}-{level}-")
                rows.append(result.row())
                print(json.dumps(result.row()), flush=True)
        finally:
            down(cfg, remove_postgres=True)
    head = (f"{'database':9s} {'runs':>4s} {'ok':>3s} {'failed':>6s} {'left':>4s} {'retries':>7s} {'task runs/s':>11s} "
            f"{'start p50 s':>11s} {'p95 s':>6s} {'server MB':>9s} {'wall s':>7s}  db errors")
    print(head)
    for r in rows:
        print(f"{r['database']:9s} {r['concurrent']:4d} {r['completed']:3d} {r['failed']:6d} {r['unfinished']:4d} "
              f"{r['submit_retries']:7d} "
              f"{r['task_runs_per_s']:11.2f} {r['start_p50_s']:11.2f} {r['start_p95_s']:6.2f} "
              f"{r['server_peak_rss_mb']:9.1f} {r['seconds']:7.1f}  {r['db_errors']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""What marks a lost flow run Crashed when the server has **no** zombie-detection automation.

The reason the fanned-out parent keeps a fallback of its own (tasks/framework/fanout.py), measured: a fresh
local stack (two gpu workers, one cpu worker) whose zombie automation is deleted after ``rde stack
up`` created it; build-largefine/pool up to the Q&A tiers on a slice of the demo pool, qa-tiers
fanned out, with an OpenAI-compatible stub generator answering after a fixed delay
(tests/pool_checks.py).

1. Mid-stage, a gpu worker and its shard-range run's process are SIGKILLed: the seconds until the
   run is Crashed, and by whom (the parent's fallback, after ``stale_after_s``).
2. Then the parent's cpu worker and the parent's process are SIGKILLed: the parent's state every
   30 s for ``--watch`` seconds. Nothing but a server automation could mark it: it stays Running.

With the automations (``rde stack up``'s default) both are marked by the server; that case is
tests/test_pool_fanout.py.

    .venv/bin/python benchmarks/lost_worker_detection.py [--stale 50] [--watch 180]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the stub generator and the stack's REST helpers
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stale", type=float, default=50.0, help="prefect.fanout.stale_after_s (seconds)")
    parser.add_argument("--watch", type=float, default=180.0, help="how long to watch the lost parent (seconds)")
    args = parser.parse_args()

    import httpx
    from pool_checks import fanout_params, flow_run, shard_runs, stub_server, submit
    from pool_scaling import _slice_pool
    from stack_checks import api, engine_pids, kill_with_its_worker

    from entry.stack import StackConfig, down, free_port, up
    from tasks.framework.prefect_automations import ZOMBIE_NAME, detects_zombies

    folder = Path(tempfile.mkdtemp(prefix="lost-worker-"))
    pool = _slice_pool(folder, 96)
    cfg = StackConfig(port=free_port(), folder=folder / "stack", gpu_workers=2, stale_after_s=args.stale)
    up(cfg)
    try:
        for automation in api(cfg, "/automations/filter", {}):
            if automation["name"] == ZOMBIE_NAME:
                httpx.delete(f"{cfg.api_url}/automations/{automation['id']}", timeout=30).raise_for_status()
        assert not detects_zombies(api(cfg, "/automations/filter", {}))
        with stub_server(delay_s=3.0) as stub:
            params = fanout_params(folder / "out", pool, stub.base_url, images=24, shard_size=4, per_run=3,
                                   stale_after_s=args.stale)
            parent = submit(cfg, params)
            victim, pids, deadline = None, [], time.monotonic() + 400
            while time.monotonic() < deadline and not pids:
                running = [r for r in shard_runs(cfg, parent) if r["state_type"] == "RUNNING"]
                if running:
                    victim, pids = running[-1], engine_pids(running[-1]["id"])
                time.sleep(0.3)
            assert victim and pids, "no shard-range run was seen running"
            kill_with_its_worker(pids[0])
            killed = time.monotonic()
            while flow_run(cfg, victim["id"])["state_type"] == "RUNNING" and time.monotonic() < killed + 600:
                time.sleep(0.5)
            lost = flow_run(cfg, victim["id"])
            print(f"1. lost shard-range run {victim['name']}: {lost['state_type']} after "
                  f"{time.monotonic() - killed:.1f} s: {lost['state']['message']!r}")
            pids = engine_pids(parent)
            assert pids, "no flow-run process of the parent was found"
            kill_with_its_worker(pids[0])
            killed = time.monotonic()
            while time.monotonic() < killed + args.watch:
                time.sleep(30)
                run = flow_run(cfg, parent)
                print(f"2. lost parent, {time.monotonic() - killed:.0f} s after the kill: {run['state_type']} "
                      f"({run['state_name']})")
    finally:
        down(cfg)


if __name__ == "__main__":
    main()

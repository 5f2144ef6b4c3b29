"""Process-wide settings: the Prefect environment and the code version (the project root and
state folder are ``storage.locations``).

Prefect reads its settings when it is first imported, so ``configure_prefect_env`` must run
before that; ``flows`` and ``tasks`` call it on import and the CLI calls it first thing.
"""

from __future__ import annotations

import logging
import os
import subprocess
from functools import lru_cache

import rde
from storage.locations import project_root, state_dir

AUTO_BATCH_LOGGER = "models.backends.auto_batch"


def configure_prefect_env() -> None:
    """Point Prefect at the project's state folder and turn analytics off (server and client).

    Values already set in the environment win, so ``PREFECT_API_URL`` selects a real server;
    without it a CLI run starts a temporary server of its own (``entry.temporary_server``).
    """
    home = state_dir() / "prefect"
    defaults = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the client side of analytics: off too, which also keeps Prefect's first-run telemetry
        # notice off a user's terminal (it printed above the first run's progress)
        "DO_NOT_TRACK": "1",
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_UI_ENABLED": "true",
        # the ephemeral server needs ~6-11 s on 2 idle cores; a busy machine can take minutes, and
        # Prefect's 20 s default then fails the run before any stage starts
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "YOLO_OFFLINE": "1",
        "YOLO_CONFIG_DIR": str(state_dir() / "ultralytics"),
        "HF_HUB_OFFLINE": "1",
        # transformers' own bars ("Loading weights" per model load): carriage returns in a pipe or
        # log file, and a second bar beside the stage lines on a terminal
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PREFECT_LOGGING_EXTRA_LOGGERS": AUTO_BATCH_LOGGER,  # measured batch sizes show in run logs
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    logging.getLogger(AUTO_BATCH_LOGGER).setLevel(logging.INFO)
    home.mkdir(parents=True, exist_ok=True)


@lru_cache(maxsize=1)
def code_version() -> str:
    """Package version plus the git commit (with ``-dirty`` for uncommitted changes) when known."""
    root = project_root()
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return f"{rde.__version__}+{sha}{'-dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return rde.__version__

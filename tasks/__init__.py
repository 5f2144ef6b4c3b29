"""Prefect tasks, grouped by stage. Each is a thin wrapper around plain functions in ``rde``."""

from rde.common.runtime import configure_prefect_env

configure_prefect_env()

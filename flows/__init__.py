"""Prefect flows: one module per pipeline users run. A flow only wires tasks."""

from rde.common.runtime import configure_prefect_env

configure_prefect_env()

"""Entry points: the CLI, the local Prefect stack, demo-data builders and load generators."""

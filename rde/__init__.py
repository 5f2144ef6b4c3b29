"""Retrieval data engine: builds retrieval datasets for surveillance domains."""

__version__ = "0.1.0"

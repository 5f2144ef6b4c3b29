"""The VEDJE-style cached joint reranker: frame-indexed compressor, training-only
future-delta head, MiniLM joint encoder with the stage-1 prior, losses, cache codecs and the
per-item Parquet cache store with its lineage check."""

"""Pieces every pipeline shares: profiles, reason codes, ingest and denoise, embeddings, top-K,
metrics, progress, run locks."""

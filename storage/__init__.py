"""Parquet artifact store: sharded artifacts with manifests, lineage and atomic writes."""

from storage.artifact import (
    Artifact,
    ArtifactError,
    ArtifactWriter,
    ShardInfo,
    content_key,
)

__all__ = ["Artifact", "ArtifactError", "ArtifactWriter", "ShardInfo", "content_key"]

"""The stages every building flow starts with: videos (video input only) → ingest → measure →
denoise, one module each."""

from __future__ import annotations

from tasks.framework.stage import Stage
from tasks.pool.denoise import Denoise
from tasks.pool.ingest import Ingest
from tasks.pool.measure import Measure
from tasks.pool.videos import Videos

# every building flow starts with these (videos only for video input)
CLEAN_POOL: tuple[Stage, ...] = (Videos(), Ingest(), Measure(), Denoise())

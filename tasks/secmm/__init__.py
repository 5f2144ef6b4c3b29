"""build-secmm's stages after denoise, one module each: near-duplicates → caption pool → statistics
→ DAP queries → CGDS gallery → MECF candidates → benchmark export → evaluation. Each is a stage of
the stage contract (``tasks/framework/stage.py``) over the paper logic in ``rde/secmm/``."""

from __future__ import annotations

from tasks.framework.stage import Stage
from tasks.secmm.caption_pool import CaptionPool
from tasks.secmm.caption_stats import CaptionStats
from tasks.secmm.cgds import Cgds
from tasks.secmm.dap import Dap
from tasks.secmm.evaluate import Evaluate
from tasks.secmm.export import Export
from tasks.secmm.mecf import Mecf
from tasks.secmm.near_duplicates import NearDuplicates

SECMM_STAGES: tuple[Stage, ...] = (NearDuplicates(), CaptionPool(), CaptionStats(), Dap(), Cgds(), Mecf(), Export(),
                                   Evaluate())

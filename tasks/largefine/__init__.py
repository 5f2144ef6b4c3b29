"""build-largefine's stages after denoise, one module each: embed images → select the images to
caption → hard negatives (GTR+ Eq. 1) → base and intermediate tiers → template gallery → advanced
tier → LargeFine export (with its dataset card) → WebDataset export. Each is a stage of the stage
contract over the logic in ``rde/largefine/``."""

from __future__ import annotations

from tasks.framework.stage import Stage
from tasks.largefine.adv_tier import AdvTier
from tasks.largefine.embed_images import EmbedImages
from tasks.largefine.export_largefine import ExportLargeFine
from tasks.largefine.export_webdataset import ExportWebDataset
from tasks.largefine.hard_negatives import HardNegatives
from tasks.largefine.qa_tiers import QaTiers
from tasks.largefine.select_images import SelectImages
from tasks.largefine.template_gallery import TemplateGallery

LARGEFINE_STAGES: tuple[Stage, ...] = (EmbedImages(), SelectImages(), HardNegatives(), QaTiers(), TemplateGallery(),
                                       AdvTier(), ExportLargeFine(), ExportWebDataset())
CAPTIONING = ("qa-tiers", "adv-tier")  # the stages whose throughput the run summary reports

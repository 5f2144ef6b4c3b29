"""Retrieval training code: contrastive and distillation losses (SAFT), confidence weighting (GTR+)."""

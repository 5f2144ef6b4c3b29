"""Retrieval training logic: SAFT and GTR+ objectives, features, GMM confidence weighting."""

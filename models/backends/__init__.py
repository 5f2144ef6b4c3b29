"""Backends: detectors now; embedders, experts and generators join behind the same pattern."""

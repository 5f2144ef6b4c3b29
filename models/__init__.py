"""Model code: backends behind small interfaces (tasks depend on models, never the reverse)."""

"""Evaluating any retriever on a built benchmark (``rde evaluate``): where a benchmark comes from,
how a retriever is named and loaded, the ranking and its metrics with bootstrap intervals, the
comparison's reports. Plain logic: the flow and its stages are in ``tasks/evaluation``."""

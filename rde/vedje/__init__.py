"""VEDJE cached joint reranker logic: items, frozen features, training and evaluation."""

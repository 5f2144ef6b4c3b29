"""The VEDJE-style cached joint reranker (issue 7): cache codecs so far."""

"""Naming and loading any text-to-image retriever for ``rde evaluate --model KIND:TARGET``.

The syntax, its forms (``FORMS``) and lineage are in ``retriever_specs``; loading and the checks
every loaded retriever's vectors pass are in ``retriever_loading``; trained students in
``retriever_student``; precomputed rankings (``scores:``) in ``scores_file``.
"""

from __future__ import annotations

from rde.evaluation.retriever_lineage import retriever_lineage
from rde.evaluation.retriever_loading import CheckedExpert, load_retriever
from rde.evaluation.retriever_specs import FORMS, KINDS, RetrieverError, RetrieverSpec, parse_retriever

__all__ = ["FORMS", "KINDS", "CheckedExpert", "RetrieverError", "RetrieverSpec", "load_retriever",
           "parse_retriever", "retriever_lineage"]

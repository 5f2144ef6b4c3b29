"""A deterministic OpenMP thread count for the k-means runs (CGDS's clusters, the near-duplicate
filter's clusters)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def at_most_two_openmp_threads() -> Iterator[None]:
    """scikit-learn's Lloyd iterations add each OpenMP thread's partial centroid sums in the
    order the threads finish: with two threads a + b = b + a, with three or more the sum (and so
    the clusters, and the gallery) could change from run to run on a many-core machine."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=2, user_api="openmp"):
        yield

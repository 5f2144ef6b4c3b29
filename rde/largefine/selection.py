"""Which accepted images build-largefine captions: the profile's domains, capped by a seeded draw."""

from __future__ import annotations

from typing import Any

from rde.common.reasons import Reason, rejected_row
from rde.common.seeds import draw_seed


def select_rows(rows: list[dict[str, Any]], domains: list[str], max_images: int | None, seed: int
            ) -> tuple[list[int], list[dict[str, Any]]]:
    """Positions in ``rows`` of the rows in the profile's domains, capped at ``max_images`` by a
    seeded, order-independent draw (by image id: a duplicate image is kept or dropped with its
    copies), in input order; every other row becomes a rejected row (``out_of_domain`` /
    ``not_sampled``). Positions, not ids, because one image may sit in two domains: only the row in
    a chosen domain is kept."""
    rejects = [rejected_row(r["image_id"], "select", Reason.OUT_OF_DOMAIN, kind="image", domain=r["domain"],
                            image_id=r["image_id"], source=r["source"],
                            detail=f"domain {r['domain']!r} not in largefine.domains {domains}")
               for r in rows if r["domain"] not in domains]
    kept = [p for p, r in enumerate(rows) if r["domain"] in domains]
    if max_images is not None and len(kept) > max_images:
        ranked = sorted(kept, key=lambda p: draw_seed(seed, rows[p]["image_id"] + "#sample"))
        chosen_ids = {rows[p]["image_id"] for p in ranked[:max_images]}
        rejects += [rejected_row(r["image_id"], "select", Reason.NOT_SAMPLED, kind="image", domain=r["domain"],
                                 image_id=r["image_id"], source=r["source"],
                                 detail=f"largefine.max_images = {max_images}")
                    for r in (rows[p] for p in kept) if r["image_id"] not in chosen_ids]
        kept = [p for p in kept if rows[p]["image_id"] in chosen_ids]
    return kept, rejects

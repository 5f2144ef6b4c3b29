"""LargeFine / GTR+ generation logic: hard negatives, three-tier captions, quality gates, template gallery."""

"""The comparison as a chart in Markdown (the Prefect UI renders Markdown artifacts, not scripts or
SVG): one bar per model and metric, its length the mean, with the interval beside it."""

from __future__ import annotations

from rde.evaluation.results import Comparison

WIDTH = 30  # characters of a full bar (a mean of 1.0)


def bar(value: float, width: int = WIDTH) -> str:
    """A bar of ``value`` in [0, 1] out of ``width`` characters, in eighths of a character."""
    eighths = round(max(0.0, min(1.0, value)) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + ("" if not part else " ▏▎▍▌▋▊▉"[part])


def chart_markdown(comparison: Comparison, domain: str = "all") -> str:
    """One table per metric: each model's bar, mean and 95 % interval (pending labels in the title)."""
    lines = [f"## {comparison.title()}", ""]
    for metric in comparison.metrics:
        lines += [f"### {metric}", "", "| model | | mean | 95 % interval |", "|---|---|---|---|"]
        for result in comparison.models:
            value = result.metrics.get(domain, {}).get(metric)
            if value is not None:
                lines.append(f"| `{result.model}` | `{bar(value.mean)}` | {value.mean:.3f} | "
                             f"[{value.low:.3f}, {value.high:.3f}] |")
        lines.append("")
    return "\n".join(lines)

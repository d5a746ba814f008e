"""Measured comparisons (`python -m benchmarks.NAME --out DIR`): each writes JSON, a PNG plot and a
markdown table, with ratios measured side by side in one run."""

"""Reproducible studies built on the library.

    python -m jaxformer.experiments.positions [configs/experiments/positions.yaml] [--seeds N]
        [section.key=value ...]

positions: one model per positional-encoding scheme, trained alike, then validation
perplexity at 1x, 2x, 4x and 8x the training length; positions_config: its config;
report: its results.json, Markdown table and plot.
"""

"""Benchmarks that write result files (JSON + a markdown table) under bench/results/: `python -m rtts.bench ...`."""

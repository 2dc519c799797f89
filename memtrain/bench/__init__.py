"""Benchmarks: scripts that measure ratios against a baseline in the same run."""

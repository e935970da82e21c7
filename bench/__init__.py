"""The benchmarks (`tokenloop-bench`, bench/__main__.py) and their harness (bench/harness.py).

bench/ is the package `tokenloop.bench` (mapped in pyproject.toml, as core/ is `tokenloop.core`), so a benchmark
imports its harness and the project as `tokenloop.*`, with no path set up by hand, from any directory.
"""

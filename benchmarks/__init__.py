"""Throughput benchmarks against the PyTorch stacks (see BENCHMARKS.md and `python -m benchmarks.run`)."""

import jmarl  # noqa: F401  (first: its host memory policy must precede the first allocations of JAX and torch threads)

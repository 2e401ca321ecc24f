"""Throughput benchmarks against the PyTorch stacks (see BENCHMARKS.md and `python -m benchmarks.run`)."""

import jmarl  # noqa: F401  (first, so that an opted-in host memory policy precedes JAX and torch threads)

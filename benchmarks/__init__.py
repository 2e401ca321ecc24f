"""Throughput benchmarks against the PyTorch stacks (see BENCHMARKS.md and `python -m benchmarks.run`)."""

import jmarl  # noqa: F401  (first, so that jmarl's host memory policy, as JMARL_KEEP_HOST_MEMORY sets it, precedes JAX and torch)

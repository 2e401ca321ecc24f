"""Throughput benchmarks against the PyTorch stacks (see docs/benchmarks.md and `python -m benchmarks.run`).

Each `python -m benchmarks.<name>` entry point applies jmarl's CPU host memory policy
(`jmarl.host_memory.apply_on_cpu`) before JAX starts; importing these modules does not."""

"""jmarl: multi-agent LLM reinforcement learning in JAX/Flax.

Importing jmarl changes nothing in the process: the CPU host memory policy
(`jmarl.host_memory.apply_on_cpu`) and the persistent compilation cache (`jmarl.compile_cache`)
are switched on by the command line (`python -m jmarl.run`), not by this import."""

from jmarl.errors import JmarlError

__all__ = ["JmarlError"]
__version__ = "0.1.0"

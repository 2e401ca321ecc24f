"""jmarl: multi-agent LLM reinforcement learning in JAX/Flax."""

from jmarl.errors import JmarlError

__all__ = ["JmarlError"]
__version__ = "0.1.0"

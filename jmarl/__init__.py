"""jmarl: multi-agent LLM reinforcement learning in JAX/Flax."""

from jmarl.errors import JmarlError
from jmarl import host_memory

if host_memory.requested():  # on unless JMARL_KEEP_HOST_MEMORY=0: before JAX starts its CPU backend
    host_memory.keep_freed_host_memory()

__all__ = ["JmarlError"]
__version__ = "0.1.0"

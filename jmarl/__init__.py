"""jmarl: multi-agent LLM reinforcement learning in JAX/Flax."""

from jmarl.errors import JmarlError
from jmarl import host_memory

if host_memory.requested():  # JMARL_KEEP_HOST_MEMORY=1: before JAX's CPU threads first allocate
    host_memory.keep_freed_host_memory()

__all__ = ["JmarlError"]
__version__ = "0.1.0"

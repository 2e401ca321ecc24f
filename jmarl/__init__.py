"""jmarl: multi-agent LLM reinforcement learning in JAX/Flax."""

from jmarl.errors import JmarlError
from jmarl.host_memory import keep_freed_host_memory

keep_freed_host_memory()  # before JAX's CPU threads first allocate; JMARL_KEEP_HOST_MEMORY=0 opts out

__all__ = ["JmarlError", "keep_freed_host_memory"]
__version__ = "0.1.0"

"""Device memory: the paged KV pool of the attention layers and the recurrent-state slot pools."""

from cairn.memory.kv_pool import KVPool, OutOfPages, PageAllocator
from cairn.memory.state_pool import OutOfSlots, StatePool

__all__ = ["KVPool", "OutOfPages", "OutOfSlots", "PageAllocator", "StatePool"]

"""dflash2: one tiered, shared KV-cache memory manager per node."""
__version__ = "0.1.0"

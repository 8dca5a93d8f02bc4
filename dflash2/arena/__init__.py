"""Tier arenas: the memory behind the block table. See base.py for the interface."""

from dflash2.arena.base import Arena, MemoryArena, StorageArena

__all__ = ["Arena", "MemoryArena", "StorageArena"]

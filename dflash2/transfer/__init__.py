"""Transfer backends: copy a batch of blocks between tier arenas. See base.py."""

from dflash2.transfer.base import CopyBatch, CopyJob, TransferBackend

__all__ = ["CopyBatch", "CopyJob", "TransferBackend"]

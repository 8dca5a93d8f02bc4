"""What a serving process imports to use dflash2.

    from dflash2.client import Client, Layout, chain_keys

`Client` attaches to dflash2d, renews its lease in the background and gives zero-copy views of
daemon-owned blocks; `chain_keys` makes the content keys that let clients share a prefix.
"""

from dflash2.client.client import Client
from dflash2.client.where import resolve_endpoint
from dflash2.client.reservation import Reservation
from dflash2.client.transport import Transport
from dflash2.errors import DaemonError, DaemonUnavailable, VersionMismatch
from dflash2.keys import chain_keys
from dflash2.layout import Layout  # (what `Client.connect(layouts=...)` takes: here, beside it)

__all__ = ["Client", "DaemonError", "DaemonUnavailable", "Layout", "Reservation", "Transport", "VersionMismatch",
           "chain_keys", "resolve_endpoint"]

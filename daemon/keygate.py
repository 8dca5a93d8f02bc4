"""The gate of a tcp endpoint: the request socket speaks CURVE as a server, and a ZAP handler (pyzmq's
authenticator, on a thread of its own) lets in only a client whose key is the key file's client key
(dflash2/tcpkeys.py). A refused connection never reaches the request loop; the refusals are logged,
at most one line a minute with their count (a port scan would otherwise fill the log)."""

from __future__ import annotations

import logging
import threading
import time

import zmq

from dflash2.tcpkeys import TcpKeys

log = logging.getLogger("dflash2.daemon")

REFUSALS_LOGGED_EVERY_S = 60.0


class KeyGate:
    def __init__(self, context: zmq.Context, keys: TcpKeys, key_file: str):
        from zmq.auth.thread import ThreadAuthenticator

        self.keys = keys
        self.key_file = key_file
        self.refused = 0  # connections refused since start
        self._unlogged = 0
        self._logged_at = -REFUSALS_LOGGED_EVERY_S
        self._lock = threading.Lock()  # (the authenticator's thread calls `callback`)
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("dflash2.daemon.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` (before bind) a CURVE server with the file's server key."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.server_public)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP handler's question: may a client with this (Z85) key connect?"""
        if client_key == self.keys.client_public:
            return True
        with self._lock:
            self.refused += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at >= REFUSALS_LOGGED_EVERY_S:
                log.warning("refused %d tcp connection%s whose key is not the one in %s (a client with another "
                            "daemon's key file, or not a dflash2 client)", self._unlogged,
                            "" if self._unlogged == 1 else "s", self.key_file)
                self._unlogged, self._logged_at = 0, now
        return False

    def close(self) -> None:
        self._auth.stop()

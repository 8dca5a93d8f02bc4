"""Which daemon a client or an operator command speaks to: the endpoint and the tcp key file, from what
was given or from the config."""

from __future__ import annotations


def resolve_endpoint(endpoint: str | None, config) -> str:
    """The endpoint given, else the config's `daemon.endpoint` (a path or a loaded Config), else the
    config's default (the runtime-folder ipc socket)."""
    if endpoint is not None:  # ("" is given, and refused by name: as Client.connect and config="")
        from dflash2.endpoints import connectable, endpoint_parts

        endpoint_parts(endpoint)  # ValueError naming what is wrong (a port with leading zeros: another key file's name)
        return connectable(endpoint)
    return config_of(config).client_endpoint()


def resolve_key_file(endpoint: str | None, config):
    """A tcp endpoint's key file (dflash2/tcpkeys.py) for `resolve_endpoint`'s endpoint: None for an
    endpoint given alone (the transport looks for tcp-PORT.key in the runtime folder), else the
    config's (`daemon.tcp_key_file`, or that default; None for an ipc endpoint)."""
    return None if endpoint is not None else config_of(config).resolved_tcp_key_file()


def config_of(config):
    """A loaded Config as it is, else the config at this path (None: dflash2_config.json here)."""
    from dflash2.config import Config, load_config

    # (None: not given; "" is given, and refused: taken for "not given", it asked another daemon, a review)
    return config if isinstance(config, Config) else load_config("dflash2_config.json" if config is None else config)

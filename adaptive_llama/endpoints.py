"""Where llama.cpp's RPC workers are: ``HOST:PORT`` lists, parsed and checked without
loading llama.cpp (the command line and config.toml read them before any model loads)."""

from __future__ import annotations

import ipaddress
import re
import socket

DEFAULT_PORT = 50052  # a worker's port unless given (llama.cpp's rpc-server default)
MAX_SERVERS = 16  # llama.cpp's GGML_RPC_MAX_SERVERS: workers one host may use
_MAX_HOST = 253  # characters of a DNS name
_HOST = re.compile(r"[A-Za-z0-9._:-]*")  # a DNS name or an IPv4 (or IPv6, refused after)


def parse_endpoints(value: str | list | tuple) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` (or a list of them) as a list of ``host:port``; one-line
    ValueError for a malformed, repeated or excess one."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if len(items) > MAX_SERVERS:
        raise ValueError(f"llama.cpp takes at most {MAX_SERVERS} workers, but {len(items)} "
                         "are given")
    endpoints = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"give workers as HOST:PORT[,HOST:PORT...], but got "
                             f"{str(value)[:100]!r}")
        endpoint = _endpoint(item.strip())
        if endpoint in endpoints:
            raise ValueError(f"the worker {endpoint} is given twice")
        endpoints.append(endpoint)
    if not endpoints:
        raise ValueError("give at least one worker as HOST:PORT")
    return endpoints


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if "://" in text:
        raise ValueError(f"{text[:80]}: give a worker as HOST:PORT, without a scheme "
                         "(llama.cpp's RPC protocol is its own, not HTTP)")
    if len(host) > _MAX_HOST or not _HOST.fullmatch(host.strip("[]")):
        raise ValueError(f"{text[:80]}: {host[:40]!r} is not a host name or address (at most "
                         f"{_MAX_HOST} letters, digits, dots, hyphens)")
    if text.startswith("[") or host.count(":"):
        raise ValueError(f"{text}: llama.cpp's RPC backend does not take IPv6 addresses; give "
                         "an IPv4 address or a host name")
    if not sep or not host:
        raise ValueError(f"{text}: give a worker as HOST:PORT (its default port is "
                         f"{DEFAULT_PORT})")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text}: the port has to be a number from 1 to 65535")
    return f"{host}:{int(port)}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IPv4 address) is this machine's loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False

"""Where a remote worker listens: a host and a port, as llama.cpp's RPC client names it.

Shared by :mod:`native.rpc` (which parses the user's addresses into these) and
:mod:`native.rpc_guard` (which finds the sockets connected to them).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

"""iroh dial addresses: ``endpoint…`` tickets and bare 64-hex peer ids, parsed for :func:`.iroh.dial`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import iroh

from ember.errors import ConnectError

from .iroh_endpoint import iroh_message

__all__ = ["Target", "is_iroh_address", "parse_address"]


@dataclass
class Target:
    """A parsed dial address."""

    peer_id: str
    addr: Any
    addresses: list[str]
    from_ticket: bool


def is_iroh_address(address: str) -> bool:
    """True for ``endpoint…`` tickets and bare 64-hex peer ids."""
    s = address.strip()
    return s.startswith("endpoint") or re.fullmatch(r"[0-9a-fA-F]{64}", s) is not None


def parse_address(address: str) -> Target:
    """Parse an ``endpoint…`` ticket or a 64-hex peer id."""
    s = address.strip()
    hint = "pass the `endpoint…` ticket printed by `ember serve` (or a 64-hex peer id where discovery is on)"
    if s.startswith("endpoint"):
        try:
            addr = iroh.EndpointTicket.from_string(s).endpoint_addr()
        except Exception as e:  # noqa: BLE001
            raise ConnectError(f"invalid iroh ticket: {iroh_message(e)}", hint=hint) from None
        addrs = list(addr.direct_addresses())
        if addr.relay_url():
            addrs.append(f"relay {addr.relay_url()}")
        return Target(str(addr.id()), addr, addrs, True)
    if re.fullmatch(r"[0-9a-fA-F]{64}", s):
        try:
            eid = iroh.EndpointId.from_string(s.lower())
        except Exception as e:  # noqa: BLE001
            raise ConnectError(f"invalid peer id {s}: {iroh_message(e)}", hint=hint) from None
        return Target(str(eid), iroh.EndpointAddr(eid, None, []), [], False)
    raise ConnectError(f"not an iroh address: {address!r}", hint=hint)

"""Sans-I/O wire protocol: message kinds (``messages``) and bytes <-> messages (``codec``)."""

from . import codec, messages
from .messages import ALPN, PROTOCOL_VERSION

__all__ = ["codec", "messages", "ALPN", "PROTOCOL_VERSION"]

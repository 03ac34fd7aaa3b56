"""The compute peer: ``Server`` hosts devices and serves sessions over any transport."""

from .backends import Backend, BackendUnavailable, make_backend
from .server import Authorizer, Server, token_authorizer

__all__ = ["Server", "Authorizer", "token_authorizer", "Backend", "BackendUnavailable", "make_backend"]

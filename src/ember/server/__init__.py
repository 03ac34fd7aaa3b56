"""The compute peer: ``Server`` hosts devices and serves sessions over any transport."""

from .execute.backends import Backend, BackendUnavailable, make_backend
from .guard.auth import allowlist_authorizer
from .server import Authorizer, Server, token_authorizer

__all__ = ["Server", "Authorizer", "token_authorizer", "allowlist_authorizer", "Backend", "BackendUnavailable", "make_backend"]

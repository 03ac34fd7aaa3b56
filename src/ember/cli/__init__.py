"""The ``ember`` command: serve, demo, and tools."""

from .main import main

__all__ = ["main"]

"""Logging for the command line: ``--log-level`` and ``--log-json``.

Every module logs under ``ember`` (``logging.getLogger("ember")`` sees it all):
``ember.server.sessions`` has one line per session opened, closed or refused,
``ember.server`` and ``ember.transport.*`` the rest, ``ember.client`` the client side.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an event's fields (``record.ember``)."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                             "level": record.levelname.lower(), "logger": record.name,
                             "message": record.getMessage()}
        fields = getattr(record, "ember", None)
        if isinstance(fields, dict):
            d.update({k: v for k, v in fields.items() if k not in d})
        if record.exc_info:
            d["exception"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def configure(level: str, as_json: bool = False) -> None:
    """Send ``ember``'s logs (and warnings from anything else) to stderr at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if as_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("ember").setLevel(getattr(logging, level.upper()))

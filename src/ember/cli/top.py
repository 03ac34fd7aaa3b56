"""``ember status`` (a peer's figures once) and ``ember top`` (the same, live, until ``q``).

Both open an admin session (``ember.connect(address, admin=True, credential=token)``) and ask
the peer for its figures with STATS (see ``ember.server.telemetry.figures``); the peer refuses anyone who
has neither its admin token nor an allowlisted iroh peer id, and the reason is printed.
``render`` draws one frame with ``rich``; ``status`` prints it once, ``top`` redraws it about
every ``--interval`` seconds (rates are differences between two frames).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from typing import Any

from ..errors import EmberError


def _size(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def _age(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _who(row: dict[str, Any]) -> str:
    if row.get("peer"):
        return f"iroh {row['peer'][:12]}…"
    return f"{row.get('transport', '?')} {row.get('remote', '')}"


def _short(text: Any, n: int) -> str:
    s = "" if text is None else str(text).replace("\n", " ")
    return s if len(s) <= n else s[:n - 1] + "…"


def _rates(snap: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, tuple[float, float, float] | None]:
    """Per session: (ops/s, bytes in/s, bytes out/s) since the previous frame (None: first sight)."""
    out: dict[str, tuple[float, float, float] | None] = {}
    before = {r["id"]: r for r in (prev or {}).get("sessions", [])}
    dt = snap["time"] - prev["time"] if prev else 0.0
    for r in snap["sessions"]:
        p = before.get(r["id"])
        out[r["id"]] = None if p is None or dt <= 0 else (
            (r["ops"] - p["ops"]) / dt, (r["bytes_in"] - p["bytes_in"]) / dt, (r["bytes_out"] - p["bytes_out"]) / dt)
    return out


#: Session columns kept on a terminal narrower than 120 columns.
NARROW = ("session", "peer / address", "dev", "ops/s", "ops", "held", "last error")


def _finished(transfers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Transfers, each once: its last phase (a "started" only while nothing followed it)."""
    out, done = [], set()
    for t in reversed(transfers):
        key = (t["session"], t["scope"], t["peer"])
        if t["phase"] == "started" and key in done:
            done.discard(key)
            continue
        if t["phase"] != "started":
            done.add(key)
        out.append(t)
    return out[::-1]


def render(snap: dict[str, Any], prev: dict[str, Any] | None, address: str, note: str = "",
           title: str = "ember top", rates: bool = True, width: int = 160) -> Any:
    """One frame: header, devices, sessions, recent transfers and errors, totals.

    ``rates``: show ops/s and bytes/s (differences from ``prev``; ``…`` until there is one).
    ``width``: the terminal's; below 120 columns the session table keeps only ``NARROW``.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    srv, tot = snap["server"], snap["totals"]
    head = Text.assemble((title, "bold"), f"  {_short(address, 60)}  ·  ember {srv['version']}  ·  up ",
                         _age(snap["uptime_s"]), f"  ·  {tot['sessions_open']} session(s) open  ·  ",
                         time.strftime("%H:%M:%S", time.localtime(snap["time"])))
    if note:
        head.append(f"  ·  {note}", style="yellow")

    devs = Table(title="devices", title_justify="left", expand=False, box=None, pad_edge=False)
    for col in ("#", "device", "name", "sessions", "tensors", "held", "budget", "memory"):
        devs.add_column(col, justify="left" if col in ("#", "device", "name") else "right")
    for d in snap["devices"]:
        budget = d.get("budget_bytes")
        used = f"{_size(d.get('budget_held_bytes') or 0)} of {_size(budget)}" if budget else "—"
        devs.add_row(str(d["index"]), d["spec"], _short(d["name"], 28), str(d["sessions"]), f"{d['tensors']:,}",
                     _size(d["bytes_held"]), used, _size(d["memory"]))

    per_s = _rates(snap, prev)
    sess = Table(title="sessions", title_justify="left", box=None, pad_edge=False)
    cols = ["session", "peer / address", "dev", "age", "ops/s", "in/s", "out/s", "ops", "tensors", "held",
            "graph hits", "last error"]
    if not rates:
        cols = [c for c in cols if not c.endswith("/s")]
    if width < 120:
        cols = [c for c in cols if c in NARROW]
    rows = []
    for r in sorted(snap["sessions"], key=lambda r: -r["ops"]):
        rate = per_s.get(r["id"])
        lookups = r["graph_hits"] + r["graph_misses"]
        hits = f"{100 * r['graph_hits'] / lookups:.0f}% of {_count(lookups)}" if lookups else "—"
        shown = [_count(rate[0]), _size(rate[1]) + "/s", _size(rate[2]) + "/s"] if rate else ["…"] * 3
        rows.append({"session": r["id"][:8] + ("*" if r["admin"] else ""), "peer / address": _short(_who(r), 32),
                     "dev": str(r["device"]), "age": _age(r["age_s"]), "ops/s": shown[0], "in/s": shown[1],
                     "out/s": shown[2], "ops": _count(r["ops"]), "tensors": f"{r['tensors']:,}",
                     "held": _size(r["bytes_held"]), "graph hits": hits, "last error": r["last_error"] or "—"})
    for col in cols:  # figures keep their width; the address and the error give way on a narrow terminal
        flexible = col in ("peer / address", "last error")
        fit = max([len(col)] + [len(row[col]) for row in rows])
        sess.add_column(col, justify="left" if col in ("session", "peer / address", "last error") else "right",
                        no_wrap=True, overflow="ellipsis", min_width=None if flexible else fit,
                        max_width=48 if col == "last error" else None)
    for row in rows:
        sess.add_row(*(Text(row[c], style="red") if c == "last error" and row[c] != "—" else row[c] for c in cols))
    if any(r["admin"] for r in snap["sessions"]):
        sess.caption, sess.caption_justify = "* an admin session (ember top, ember status)", "left"

    parts: list[Any] = [head, Text(""), devs, Text(""), sess]
    transfers = _finished(snap["recent"]["transfers"])[-5:]
    if transfers:
        tt = Table(title="recent transfers", title_justify="left", box=None, pad_edge=False)
        for col in ("time", "session", "scope", "phase", "bytes", "seconds", "peer", "error"):
            tt.add_column(col, no_wrap=col != "error", overflow="ellipsis")
        for t in reversed(transfers):
            tt.add_row(time.strftime("%H:%M:%S", time.localtime(t["t"])), (t["session"] or "—")[:8], t["scope"],
                       t["phase"], _size(t["nbytes"]), f"{t['seconds']:.2f}", _short(t["peer"], 24),
                       _short(t["error"], 50) or "—")
        parts += [Text(""), tt]
    errors = snap["recent"]["errors"][-5:]
    if errors:
        et = Table(title="recent errors", title_justify="left", box=None, pad_edge=False)
        for col in ("time", "session", "kind", "op", "message"):
            et.add_column(col, no_wrap=col != "message", overflow="ellipsis")
        for e in reversed(errors):
            et.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), (e["session"] or "—")[:8], e["kind"],
                       _short(e["op"], 20) or "—", Text(_short(e["message"], 90), style="red"))
        parts += [Text(""), et]
    refused = ", ".join(f"{k} {v}" for k, v in tot["sessions_refused"].items()) or "none"
    parts += [Text(""), Text(
        f"totals  {_count(tot.get('ops', 0))} ops · {_size(tot.get('bytes_in', 0))} in · "
        f"{_size(tot.get('bytes_out', 0))} out · {tot['sessions_opened']} sessions opened · refused: {refused} · "
        f"graph caching saved {_size(tot.get('graph_saved_bytes', 0))} · "
        f"{sum(tot['errors'].values())} errors", style="dim")]
    return Group(*parts)


def _connect(args: argparse.Namespace) -> Any:
    import ember
    if args.key:
        from ..keys import load_key
        from ..transport.iroh import configure_client
        configure_client(key=load_key(args.key))
    token = args.token if args.token is not None else os.environ.get("EMBER_ADMIN_TOKEN", "")
    return ember.connect(args.address, admin=True, credential=token, timeout=args.timeout,
                         read_timeout=args.timeout, graphs=False)


def status(args: argparse.Namespace) -> int:
    """Print the peer's figures once (a table, or JSON with --json)."""
    dev = _connect(args)
    try:
        snap = dev.peer_stats()
    finally:
        dev.close()
    if args.json:
        print(json.dumps(snap, indent=1, default=str))
        return 0
    from rich.console import Console
    console = Console(width=max(100, _columns()))
    console.print(render(snap, None, args.address, title="ember status", rates=False, width=console.width))
    return 0


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except OSError:
        return 140


class _Keys:
    """``q`` from a terminal without Enter (cbreak mode), restored on exit; nothing when stdin is not a TTY."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin and sys.stdin.isatty() else None
        self._saved: Any = None

    def __enter__(self) -> "_Keys":
        if self.fd is not None:
            import termios
            import tty
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait_for_quit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when the user pressed q (or Q)."""
        if self.fd is None:
            time.sleep(timeout)
            return False
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and os.read(self.fd, 1) in (b"q", b"Q"):
                return True


def top(args: argparse.Namespace) -> int:
    """Redraw the peer's figures about every ``--interval`` seconds until ``q`` or Ctrl-C."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    dev = _connect(args)  # a refusal (wrong token, not an admin peer) raises here, with the reason
    console = Console()
    prev: dict[str, Any] | None = None
    try:
        with _Keys() as keys, Live(Text("ember top: waiting for figures…"), console=console, screen=console.is_terminal,
                                   auto_refresh=False, redirect_stderr=False) as live:
            while True:
                note = "q quits"
                try:
                    snap = dev.peer_stats()
                except EmberError as e:  # the peer went away: say so, keep trying
                    live.update(Text(f"ember top: {args.address[:60]}: {e.message} (retrying; q quits)"),
                                refresh=True)
                else:
                    live.update(render(snap, prev, args.address, note, width=console.width), refresh=True)
                    prev = snap
                if keys.wait_for_quit(max(0.1, args.interval)):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        dev.close()

"""What an operator sees: the probe sessions emit events to (``probe``, ``events``), the aggregates
and snapshots behind STATS (``figures``), Prometheus ``/metrics`` (``metrics``) and the session log
(``session_log``). It imports nothing else of the server: the peer's own state reaches it through
the ``Server`` object it is given."""

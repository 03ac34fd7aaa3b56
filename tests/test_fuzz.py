"""The protocol fuzzer, short and seeded (``bench/bench_fuzz.py`` runs >= 100,000 cases)."""

from __future__ import annotations

import pytest

from ember.bench import fuzz


@pytest.mark.timeout(180)
def test_a_seeded_fuzz_run_finds_no_crash_no_hang_and_the_canary_stays_right():
    report = fuzz.run(cases=1600, seed=20240601, corpus=300, hang_timeout=20.0)
    assert report.cases >= 1600
    assert not report.crashes, report.crashes[:3]
    assert not report.hangs, report.hangs[:3]
    assert report.canary_checks > 0 and not report.canary_failures, report.canary_failures[:3]
    assert report.alive_after and report.budget_after == 0, report.summary()
    assert set(report.kinds) == {"session", "data", "tcp", "first", "iroh"}


def test_the_fuzzer_counts_what_the_peer_logs_as_a_crash():
    """A crash detector that detects nothing would make the test above meaningless."""
    import logging
    report = fuzz.Report()
    handler = fuzz._CrashLog(report)
    logging.getLogger("ember.server").addHandler(handler)
    try:
        logging.getLogger("ember.server").error("session x: batch failed")
        logging.getLogger("unrelated").error("not ours")
    finally:
        logging.getLogger("ember.server").removeHandler(handler)
    assert len(report.crashes) == 1 and not report.ok()

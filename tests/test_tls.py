"""WebSocket over TLS (wss://): a verified peer works, an unverified one is refused clearly."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import ConnectError

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
    return d


@pytest.mark.timeout(60)
def test_wss_serve_and_connect(certs):
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--no-iroh", "--websocket",
                          "127.0.0.1:0", "--tls-cert", str(certs / "server.pem")],
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = p.stdout.readline()
        addr = re.search(r"(wss://\S+)", line).group(1)
        d = ember.connect(addr, tls_ca=str(certs / "ca.pem"))
        np.testing.assert_array_equal((xp.arange(4, device=d) * 2).to_numpy(), np.arange(4) * 2)
        d.close()
        with pytest.raises(ConnectError, match="certificate"):
            ember.connect(addr)  # the system CAs don't know this test CA
    finally:
        p.kill()


def test_bad_tls_files_are_a_clear_error(tmp_path):
    bad = tmp_path / "nope.pem"
    bad.write_text("not a certificate")
    r = subprocess.run([sys.executable, "-m", "ember.cli.main", "serve", "--no-iroh", "--websocket", "127.0.0.1:0",
                        "--tls-cert", str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "TLS certificate" in r.stderr and "Traceback" not in r.stderr

"""A small read overtakes queued work on the peer only when that work cannot change it
(``server/read_ahead.py``), over TCP to an ``ember serve`` process: Hugging Face's NaN filter
(``torch.isnan(loss)`` after the backward) and its in-order counterparts."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(180)

#: one matmul of this size keeps the peer's worker busy for tens of milliseconds or more: what the client
#: sends meanwhile queues behind it
N = 1024


def _read_aheads(dev: ember.Device) -> int:
    return dev.stats()["peer"]["session"]["read_aheads"]


def _stats(dev: ember.Device) -> dict:
    return dev.stats()["peer"]["session"]


def _between(dev: ember.Device) -> int:
    return _stats(dev)["reads_between"]


def _busy(dev: ember.Device, a: torch.Tensor, n: int = 1) -> torch.Tensor:
    """A slow batch of its own, ``n`` matmuls (the worker runs it while the next ones queue)."""
    b = a
    for _ in range(n):
        b = b @ a
    dev.session.flush()
    return b


def test_a_read_of_untouched_values_overtakes_and_one_of_written_values_waits(tcp_peer: str) -> None:
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            a = torch.randn(N, N).to("ember") / N
            z, x = torch.ones(3).to("ember"), torch.zeros(3).to("ember")
            dev.sync()
            before = _read_aheads(dev)
            ac = a.cpu()
            for k in range(1, 6):  # (until one overtakes: a loaded machine may run the first batch before the
                b1 = _busy(dev, a, 4)  # others arrive, and then nothing is queued to overtake; in order, the same)
                b2 = b1 @ a
                x.add_(1)  # queued behind the first batch, with the second matmul
                dev.session.flush()
                assert z.sum().item() == 3.0  # reads nothing queued work writes: it may overtake the second batch
                assert x.sum().item() == 3.0 * k  # x is written by queued work: read after it, never before
                torch.testing.assert_close(b2.cpu(), ac @ ac @ ac @ ac @ ac @ ac, rtol=1e-4, atol=1e-4)
                if _read_aheads(dev) > before:
                    break
            assert _read_aheads(dev) - before >= 1
    finally:
        dev.close()


def test_a_read_of_batch_norm_statistics_waits_for_the_batch_norm(tcp_peer: str) -> None:
    """``native_batch_norm`` writes its running statistics though its schema does not say so: a read of them waits
    for a queued batch norm (it overtook it on a busy peer, answering the statistics before the update)."""
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            a = torch.randn(N, N).to("ember") / N
            bn, ref, x = torch.nn.BatchNorm1d(3).to("ember"), torch.nn.BatchNorm1d(3), torch.randn(8, 3)
            dev.sync()
            for _ in range(4):
                _busy(dev, a, 4)
                bn(x.to("ember"))
                ref(x)
                dev.session.flush()
                # (this step's statistics, not the last step's, ~10% apart; a peer on all its cores may round the
                torch.testing.assert_close(bn.running_mean.cpu(), ref.running_mean, rtol=1e-5, atol=1e-7)  # mean)
    finally:
        dev.close()


def test_a_read_waits_for_a_queued_replayed_graph_that_writes_what_it_reads(tcp_peer: str) -> None:
    """The same in-place steps every time (a graph replayed once cached), queued behind a slow batch: a read of
    what the graph writes waits for it."""
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            a = torch.randn(N // 2, N // 2).to("ember")
            p, want = torch.zeros(3).to("ember"), torch.zeros(3)
            replays = dev.session.stats["replays"]
            for _ in range(6):
                _busy(dev, a)
                for t in (p, want):
                    for _ in range(4):  # (a group long enough to be cached: 12 ops)
                        t.add_(t * 2 + 1)  # p <- 3p + 1, in place
                dev.session.flush()  # (a batch of its own: the group, replayed once cached)
                assert p.sum().item() == want.sum().item()
            assert dev.session.stats["replays"] > replays
    finally:
        dev.close()


def test_random_draws_keep_their_order(tcp_peer: str) -> None:
    """A read batch that draws random numbers never overtakes: the session's stream keeps the program's order."""
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            a = torch.randn(N, N).to("ember") / N

            def draws(queued: bool) -> tuple[float, float]:
                torch.manual_seed(7)
                if queued:
                    _busy(dev, a)
                r1 = torch.rand(5, device="ember")
                dev.session.flush()  # (its own batch, queued behind the matmul)
                s2 = torch.rand(5, device="ember").sum().item()
                return r1.sum().item(), s2
            assert draws(True) == draws(False)
    finally:
        dev.close()


def _thrice_plus_one(p: torch.Tensor) -> None:
    for _ in range(4):
        p.add_(p * 2 + 1)  # p <- 3p + 1, in place


def _slow_group(a: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A group of its own, replayed once cached: eight slow matmuls (the peer runs them for ~0.2 s or more), then
    ``p <- 3p + 1`` in place, four times."""
    b = a
    for _ in range(8):
        b = b @ a
    _thrice_plus_one(p)
    return b


def test_a_read_runs_between_the_steps_of_a_replay_that_cannot_change_it(tcp_peer: str) -> None:
    """A read that comes while a long replayed graph runs is answered between two of its steps; a read of what that
    graph writes waits for it whole."""
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            a = torch.randn(N, N).to("ember") / N
            z, p, want = torch.ones(3).to("ember"), torch.zeros(3).to("ember"), torch.zeros(3)
            for _ in range(3):  # (seen, then replayed)
                _slow_group(a, p)
                _thrice_plus_one(want)
                dev.session.flush()
                dev.sync()
            assert p.sum().item() == want.sum().item()
            for _ in range(5):  # (until one ran mid-replay: a loaded client may send its read after the graph ended)
                before, replays = _between(dev), dev.session.stats["replays"]
                hits = _stats(dev)["graph_hits"]
                _slow_group(a, p)
                _thrice_plus_one(want)
                dev.session.flush()  # (the group alone: one REPLAY)
                assert dev.session.stats["replays"] > replays
                deadline = time.monotonic() + 60  # the replay has begun: the peer counts its hit as it starts (a
                while _stats(dev)["graph_hits"] == hits and time.monotonic() < deadline:  # STATS alone is answered
                    time.sleep(0.001)  # at once, even while the worker runs)
                assert z.sum().item() == 3.0  # reads nothing the graph writes: answered between its steps
                assert p.sum().item() == want.sum().item()  # p is written by the graph: read after it, never during
                if _between(dev) > before:
                    break
            assert _between(dev) > before
    finally:
        dev.close()


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(256, 768), torch.nn.Linear(768, 768), torch.nn.Linear(768, 768)
        self.d = torch.nn.Linear(768, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def _nan_filtered_training(device: str, steps: int = 10, released: bool = False) -> tuple[list[float],
                                                                                         list[torch.Tensor]]:
    """The Hugging Face Trainer's step, as it reads: backward, then ``isnan`` / ``isinf`` of the detached loss
    (two reads), then clipping and AdamW. ``released``: the value checked is a temporary made after the
    backward and released before the read, with an unrelated op between (the read's own op alone after the
    group's last chunk: that chunk must keep the temporary)."""
    torch.manual_seed(0)
    m = _MLP().to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    skipped, losses = 0, []
    for _ in range(steps):
        x, y = torch.randn(384, 256, generator=g), torch.randint(0, 10, (384,), generator=g)
        x, y = x.to(device), y.to(device)  # (the batch on the device first, as the Trainer puts it there)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        tr = loss.detach()
        if released:
            t = tr * 1.0
            _unrelated = m.d.bias * 1.0
            bad = torch.isnan(t)
            del t
            skipped += bool(bad)
        elif torch.isnan(tr) or torch.isinf(tr):
            skipped += 1
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(tr)
    assert not skipped
    return [v.item() for v in losses], [p.detach().cpu() for p in m.parameters()]


@pytest.mark.parametrize("released", [False, True], ids=["loss", "released-temporary"])
def test_trainer_nan_filter_reads_ahead_and_trains_the_same_model(tcp_peer: str, released: bool) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as the peer, OMP_NUM_THREADS=1: a matmul's rounding depends on its threads)
    try:
        want_losses, want = _nan_filtered_training("cpu", released=released)
    finally:
        torch.set_num_threads(threads)
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            before = _read_aheads(dev)
            losses, got = _nan_filtered_training("ember", released=released)
            ahead = _read_aheads(dev) - before
    finally:
        dev.close()
    assert losses == want_losses
    for p, q in zip(got, want):
        assert torch.equal(p, q)
    if not released:
        assert ahead > 0  # the filter's reads answered before the backward's queued chunks ran
    # (released: the value checked is made by the group's last chunk, so its read rightly waits for that chunk)


def test_the_trainer_step_goes_out_in_chunks_cut_where_the_loss_is_final(tcp_peer: str) -> None:
    """Under the Trainer's filter the step goes out in chunks as it is recorded: the forward in two (one when it is
    shorter than two chunks' minimum, as this model's), the last ending with the loss (what the read waits for),
    and the backward at the read (``_chunk_plan``)."""
    dev = ember.connect(tcp_peer)
    try:
        with dev:
            _nan_filtered_training("ember", steps=6)
            late = [c for cl in dev.session._cands.values() for c in cl if c.late]
    finally:
        dev.close()
    assert late, "the step never went out in chunks"
    c = late[0]
    assert c.cut and c.names[c.cut - 1].startswith("aten.nll_loss")  # the forward ends with the loss
    assert sorted(c.chunks) == sorted({0, min(c.late, c.cut), c.cut})  # the forward's chunks, then the backward
    assert c.n - c.tail > c.cut

"""A mesh of two real `ember serve --device torch:cpu --collectives` peers on loopback: collectives among
the peers (torch.distributed gloo), DataParallel bit-equal to torch's DistributedDataParallel over gloo
in two local processes (an MLP and a small GPT; each step replayed as one op graph on every peer, the
client encoding each batch once), no_sync, a poisoned rank in a replayed step, two meshes on the same
peers, a killed peer, budgets, refusals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import LimitExceeded, RemoteExecutionError  # noqa: E402
from ember.protocol import messages as m  # noqa: E402
from ember.server import Server  # noqa: E402
from ember.torch import DataParallel, MeshError, MeshPeerLost  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from ddp_reference import batches, loss_of, make_mlp, make_model, make_optimizer  # noqa: E402
from test_core_cli import address_of as serve_address, spawn_serve  # noqa: E402

ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
       "OMP_NUM_THREADS": "1"}
REFERENCE = str(Path(__file__).parent / "ddp_reference.py")
HOLD = 2.0  # (graph_hold: a loaded box may take more than the default 20 ms to record a step; tests that
            # count replays hold a recurring group that long)


def spawn_peer() -> subprocess.Popen:
    return spawn_serve("--device", "torch:cpu", "--collectives", "--no-iroh", "--tcp", "127.0.0.1:0", env=ENV,
                       stderr=subprocess.DEVNULL)


def address_of(p: subprocess.Popen) -> str:
    """The peer's address, once it says it listens (the readiness signal)."""
    return serve_address(p, r"listening on (tcp://\S+)", timeout=45)


def start_peer() -> tuple[subprocess.Popen, str]:
    p = spawn_peer()
    return p, address_of(p)


@pytest.fixture(scope="module")
def peers():
    started = [spawn_peer() for _ in range(2)]  # both start at once
    try:
        yield [address_of(p) for p in started]
    finally:
        for p in started:
            p.kill()
            p.wait(10)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def reference(tmp_path, steps: int, kind: str = "mlp") -> tuple[list[subprocess.Popen], Path]:
    """torch DDP over gloo in two local processes (tests/ddp_reference.py), started now."""
    out, port = tmp_path / f"ref-{kind}.pt", free_port()
    env = {**ENV, "DDP_REFERENCE_MODEL": kind}
    return [subprocess.Popen([sys.executable, REFERENCE, str(r), "2", str(port), str(out), str(steps)], env=env)
            for r in range(2)], out


def reference_params(procs: list[subprocess.Popen], out: Path) -> list[torch.Tensor]:
    for p in procs:
        assert p.wait(90) == 0
    return torch.load(out)["params"]


@pytest.mark.timeout(120)
def test_data_parallel_is_bit_equal_to_torch_ddp_over_gloo(peers, tmp_path):
    steps = 5
    ref, out = reference(tmp_path, steps)
    mesh = ember.torch.mesh(peers, timeout=20, graph_hold=HOLD)
    try:
        with mesh:
            model = DataParallel(make_mlp().to("ember"))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in batches(steps):
                opt.zero_grad()
                loss = loss_of(model, mesh.shard(x), mesh.shard(y))
                loss.backward()
                opt.step()
            got = [p.detach().cpu() for p in model.parameters()]
            mean_loss = mesh.mean(loss).item()
        leader, follower = mesh.session.peers
        assert leader.stats["replays"] >= steps - 2  # each step after the second is one REPLAY...
        own = follower.stats["ops"]  # messages for rank 1 alone: its join and its shards (x, y a step)
        assert own <= 2 * steps + 2 < leader.stats["ops"] and follower.stats["bytes_sent"] >= leader.stats["bytes_sent"] // 2
    finally:  # ... encoded once by rank 0's session, the same frames sent to rank 1
        mesh.close()
    want = reference_params(ref, out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # ... and close to one process training on the whole batch
    whole = make_mlp()
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    for x, y in batches(steps):
        opt.zero_grad()
        with torch.no_grad():  # the last step's loss on each half, before the step
            halves = [loss_of(whole, xs, ys).item() for xs, ys in zip(x.chunk(2), y.chunk(2))]
        loss_of(whole, x, y).backward()
        opt.step()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, whole.parameters()))
    assert mean_loss == pytest.approx(sum(halves) / 2, rel=1e-5)  # the mean over the peers, not rank 0's


def train_on_mesh(peers: list[str], kind: str, steps: int, after: Any = None) -> tuple[list[Any], Any]:
    """DataParallel training of ``make_model(kind)`` on a mesh of ``peers``, as the DDP reference trains it: the
    parameters, and what ``after(mesh, model)`` reads before the mesh closes."""
    mesh = ember.torch.mesh(peers, timeout=30)
    try:
        with mesh:
            model = DataParallel(make_model(kind).to("ember"))
            opt = make_optimizer(model.parameters(), kind=kind)
            for x, y in batches(steps, kind=kind):
                opt.zero_grad()
                loss_of(model, mesh.shard(x), mesh.shard(y), kind=kind).backward()
                opt.step()
            return [p.detach().cpu() for p in model.parameters()], after(mesh, model) if after else None
    finally:
        mesh.close()


@pytest.mark.timeout(150)
def test_a_small_gpt_is_bit_equal_to_torch_ddp_over_gloo(peers, tmp_path):
    steps = 4
    ref, out = reference(tmp_path, steps, "gpt")
    got, tied = train_on_mesh(peers, "gpt", steps, lambda _mesh, m: m.module.wte.weight is m.module.lm_head.weight)
    assert tied  # one parameter
    want = reference_params(ref, out)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), max((a - b).abs().max().item() for a, b in zip(got, want))


@pytest.mark.timeout(150)
def test_batch_norm_buffers_and_an_unused_parameter_are_as_under_torch_ddp(peers, tmp_path):
    """DDP broadcasts rank 0's buffers before every training forward (``broadcast_buffers=True``), and leaves an
    unused parameter's gradient None (``find_unused_parameters=True``): rank 1's running statistics and the
    unused layer under weight decay drifted from DDP's (0.02, 0.01) when buffers went out once and unused
    gradients were zeros."""
    steps = 4
    ref, out = reference(tmp_path, steps, "bn")

    def after(mesh: Any, model: Any) -> list[Any]:
        assert model.module.unused.weight.grad is None
        return [mesh.mean(b).cpu() for b in model.module.buffers() if b.is_floating_point()]
    got, bufs = train_on_mesh(peers, "bn", steps, after)
    want = reference_params(ref, out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    r0, r1 = (torch.load(f"{out}.buffers{r}") for r in range(2))
    assert not torch.equal(r0[0], r1[0])  # (the ranks' statistics differ: each saw its own half)
    want_bufs = [(a + b) / 2 for a, b in zip(r0, r1) if a.is_floating_point()]
    assert all(torch.equal(a, b) for a, b in zip(bufs, want_bufs))


@pytest.mark.timeout(150)
def test_torch_compile_on_a_mesh_is_bit_equal_to_torch_ddp(peers, tmp_path):
    from ember.torch import _compile
    steps = 5
    ref, out = reference(tmp_path, steps)
    mesh = ember.torch.mesh(peers, timeout=20, graph_hold=HOLD)
    replays = _compile.stats["replays"]
    try:
        with mesh:
            model = DataParallel(make_mlp().to("ember"))
            run = torch.compile(model, backend="ember")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in batches(steps):
                opt.zero_grad()
                loss_of(run, mesh.shard(x), mesh.shard(y)).backward()
                opt.step()
            got = [p.detach().cpu() for p in model.parameters()]
    finally:
        mesh.close()
    assert _compile.stats["replays"] > replays  # the compiled graphs were recorded once, then replayed
    want = reference_params(ref, out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.timeout(90)
def test_no_sync_accumulates_locally_then_averages(peers):
    (x1, y1), (x2, y2) = batches(2)
    mesh = ember.torch.mesh(peers, timeout=20)
    try:
        with mesh:
            model = DataParallel(make_mlp().to("ember"), bucket_cap_mb=0.001)  # several buckets
            assert len(model.buckets) > 1
            with model.no_sync():
                loss_of(model, mesh.shard(x1), mesh.shard(y1)).backward()
            loss_of(model, mesh.shard(x2), mesh.shard(y2)).backward()
            got = [p.grad.cpu() for p in model.parameters()]
    finally:
        mesh.close()
    per_rank = []
    for r in range(2):
        ref = make_mlp()
        loss_of(ref, x1.chunk(2)[r], y1.chunk(2)[r]).backward()
        loss_of(ref, x2.chunk(2)[r], y2.chunk(2)[r]).backward()
        per_rank.append([p.grad for p in ref.parameters()])
    want = [a / 2 + b / 2 for a, b in zip(*per_rank)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.timeout(60)
def test_collectives_run_among_the_peers(peers):
    mesh = ember.torch.mesh(peers, timeout=20)
    try:
        with mesh:
            x = mesh.shard(torch.tensor([[1.0, 2.0], [10.0, 20.0]]))  # rank 0: [1, 2], rank 1: [10, 20]
            s = x.clone()
            mesh.all_reduce(s)
            assert s.cpu().tolist() == [[11.0, 22.0]]
            b = x.clone()
            mesh.broadcast(b, src=1)
            assert b.cpu().tolist() == [[10.0, 20.0]]
            g = torch.empty(4, device="ember")
            mesh.all_gather_into_tensor(g, x.reshape(-1).clone())
            assert g.cpu().tolist() == [1.0, 2.0, 10.0, 20.0]
            r = torch.empty(1, device="ember")
            mesh.reduce_scatter_tensor(r, x.reshape(-1).clone())
            assert r.cpu().tolist() == [11.0]  # rank 0's half of the sum
            a, b = x.clone(), x.clone() * 2  # several operands: each reduced on its own (coalesced)
            mesh.all_reduce(a, b)
            assert a.cpu().tolist() == [[11.0, 22.0]] and b.cpu().tolist() == [[22.0, 44.0]]
            c, d = x.clone(), x.clone() + 1
            mesh.broadcast(c, d, src=1)
            assert c.cpu().tolist() == [[10.0, 20.0]] and d.cpu().tolist() == [[11.0, 21.0]]
            w = mesh.all_reduce(x, op="max", async_op=True)
            assert w is not None
            w.wait()
            assert x.cpu().tolist() == [[10.0, 20.0]]
            assert mesh.mean(torch.ones(2, device="ember") * 3).cpu().tolist() == [3.0, 3.0]
            mesh.barrier()
    finally:
        mesh.close()


@pytest.mark.timeout(60)
def test_a_poisoned_input_on_one_rank_still_joins_and_poisons_every_rank(peers):
    mesh = ember.torch.mesh(peers, timeout=20)
    try:
        with mesh:
            w = torch.ones(2, 3, device="ember")
            idx = mesh.shard(torch.tensor([0, 5]))  # rank 1's index is out of range: only rank 1 fails
            bad = torch.index_select(w, 0, idx)
            mesh.all_reduce(bad)
            with pytest.raises(RemoteExecutionError, match="poisoned on a peer"):
                bad.cpu()
            good = torch.ones(2, device="ember")  # the group goes on
            mesh.all_reduce(good)
            assert good.cpu().tolist() == [2.0, 2.0]
    finally:
        mesh.close()


@pytest.mark.timeout(60)
def test_a_poisoned_rank_in_a_replayed_step_still_joins_and_poisons_every_rank(peers):
    mesh = ember.torch.mesh(peers, timeout=20, graph_hold=HOLD)
    try:
        with mesh:
            w = torch.arange(6.0, device="ember").reshape(3, 2)

            def step(idx: list[int]) -> torch.Tensor:  # a group of ops between two boundaries
                r = torch.index_select(w, 0, mesh.shard(torch.tensor(idx)))
                for _ in range(4):
                    r = (r * 2 + 1).sin()
                mesh.all_reduce(r)
                return r
            want = step([0, 1]).cpu()
            for _ in range(3):
                assert torch.equal(step([0, 1]).cpu(), want)
            replays = mesh.session.leader.stats["replays"]
            bad = step([0, 7])  # rank 1's index is out of range: only rank 1 fails, in a replayed step
            with pytest.raises(RemoteExecutionError, match="poisoned on a peer"):
                bad.cpu()
            assert mesh.session.leader.stats["replays"] == replays + 1
            assert torch.equal(step([0, 1]).cpu(), want)  # the group goes on
    finally:
        mesh.close()


def in_process_peers(**options) -> list[Server]:
    servers = []
    for _ in range(2):
        s = Server(["torch:cpu"], collectives=True, dist_host="127.0.0.1", **options)
        s.listen_tcp("127.0.0.1", 0)
        servers.append(s)
    return servers


@pytest.mark.timeout(60)
def test_every_peer_gets_the_same_batches_and_frees_the_same_tensors():
    servers = in_process_peers()
    try:
        mesh = ember.torch.mesh([s.start_in_thread()[0] for s in servers], timeout=10)
        with mesh:
            keep = torch.ones(4, device="ember")
            for i in range(40):  # own shards (one per peer), ops sent once to both, drops to both
                t = (mesh.shard(torch.arange(8.0) + i) * 2).sum()
                del t
            mesh.sync()
            held = [sorted(s.interp.tensors) for srv in servers for s in list(srv.live)]
            assert len(held) == 2 and held[0] == held[1] and len(held[0]) <= 3, held
            assert mesh.mean(keep).cpu().tolist() == [1.0] * 4
        mesh.close()
    finally:
        for s in servers:
            s.close()


@pytest.mark.timeout(60)
def test_what_a_collective_holds_is_charged_to_the_session_budget():
    servers = in_process_peers(session_memory=1 << 20)  # a 1 MiB session budget
    try:
        mesh = ember.torch.mesh([s.start_in_thread()[0] for s in servers], timeout=10)
        with mesh:
            a, b = torch.ones(300_000 // 4, device="ember"), torch.ones(300_000 // 4, device="ember")
            mesh.all_reduce(a, b)  # 600 kB held + a 600 kB flat copy: over the budget on both peers
            with pytest.raises(LimitExceeded, match="holds while it runs"):
                a.cpu()
            small = torch.ones(1000, device="ember")
            c = small * 3
            mesh.all_reduce(small, c)  # within it: the group goes on
            assert small.cpu()[0].item() == 2.0 and c.cpu()[0].item() == 6.0
        mesh.close()
    finally:
        for s in servers:
            s.close()


@pytest.mark.timeout(60)
def test_two_meshes_on_the_same_peers_do_not_cross(peers):
    one, two = ember.torch.mesh(peers, timeout=20), ember.torch.mesh(peers[::-1], timeout=20)
    try:
        with one:
            a = one.shard(torch.tensor([1.0, 2.0]))
        with two:
            b = two.shard(torch.tensor([100.0, 200.0]))
        wa, wb = one.all_reduce(a, async_op=True), two.all_reduce(b, async_op=True)
        wb.wait()
        wa.wait()
        assert a.cpu().tolist() == [3.0] and b.cpu().tolist() == [300.0]
    finally:
        one.close()
        two.close()


@pytest.mark.timeout(90)
def test_a_killed_peer_is_named_within_the_group_timeout_and_the_survivor_carries_on(peers):
    victim, addr = start_peer()
    try:
        mesh = ember.torch.mesh([peers[0], addr], timeout=5)
        with mesh:
            model = DataParallel(make_mlp().to("ember"))
            x, y = batches(1)[0]
            loss_of(model, mesh.shard(x), mesh.shard(y)).backward()
            assert mesh.mean(torch.ones(1, device="ember")).item() == 1.0
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            t0 = time.monotonic()
            with pytest.raises(MeshPeerLost, match=re.escape(addr)):
                for _ in range(50):  # the loss reaches the client at the next op or read
                    loss_of(model, mesh.shard(x), mesh.shard(y)).backward()
                    mesh.mean(torch.ones(1, device="ember")).item()
            assert time.monotonic() - t0 < 5 + 15
            with pytest.raises(MeshPeerLost, match="form a new one"):  # any later op: the mesh's kind and hint
                model.module[0].weight * 2
        mesh.close()
        survivor = ember.connect(peers[0])
        with survivor:
            assert (torch.arange(4.0, device="ember") * 2).sum().item() == 12.0
        survivor.close()
    finally:
        victim.kill()


@pytest.mark.timeout(60)
def test_a_peer_without_collectives_fails_at_mesh_naming_it(peers):
    plain = Server(["torch:cpu"])
    plain.listen_websocket("127.0.0.1", 0)
    addr = plain.start_in_thread()[0]
    try:
        with pytest.raises(MeshError, match=re.escape(addr)):
            ember.torch.mesh([addr, peers[0]], timeout=5)
        with pytest.raises(MeshError, match="not a torch"):
            numpy_peer = Server(["cpu"])
            numpy_peer.listen_websocket("127.0.0.1", 0)
            try:
                ember.torch.mesh([numpy_peer.start_in_thread()[0]])
            finally:
                numpy_peer.close()
    finally:
        plain.close()


@pytest.mark.timeout(60)
def test_a_peer_reaches_only_stores_its_operator_allows(peers):
    dev = ember.connect(peers[0])
    try:
        s = dev.session
        for store in ("8.8.8.8:53", "example.com:80", "127.0.0.1:99999"):
            tid = next(s.ids)
            s.record([m.OP, "torch.dist.join", [], 0, [tid], {"g": "x" * 32, "store": store, "rank": 0, "size": 2,
                                                             "timeout": 1.0, "backend": "gloo"}])
            with pytest.raises(RemoteExecutionError, match="store"):
                s.read(tid)
        tid = next(s.ids)  # a collective on a group this session never joined: refused, session alive
        s.record([m.OP, "torch.dist.barrier", [], 0, [tid], {"g": "y" * 32}])
        with pytest.raises(RemoteExecutionError, match="no such process group"):
            s.read(tid)
        with dev:
            assert torch.ones(3, device="ember").sum().item() == 3.0
    finally:
        dev.close()

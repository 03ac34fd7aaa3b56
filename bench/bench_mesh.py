"""Steps/s and client CPU of DataParallel on a 2-peer mesh vs one peer with the same global batch, vs
torch's DistributedDataParallel over gloo in two local processes (tests/ddp_reference.py), in one run.

``python bench/bench_mesh.py [STEPS] [GLOBAL_BATCH] [HIDDEN] [--rounds N]`` (peers: two
`ember serve --device torch:cpu --collectives` started here). Each round trains a fresh model for
STEPS steps on one peer, then on the mesh, then with torch DDP; the medians over the rounds are
printed, and the ratios of the medians (same run, same box)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", type=int, nargs="?", default=30, help="steps per round (the first is not timed)")
    p.add_argument("batch", type=int, nargs="?", default=256, help="the global batch (split over the mesh)")
    p.add_argument("hidden", type=int, nargs="?", default=512, help="the MLP's hidden width")
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians are printed)")
    p.add_argument("--pin", action="store_true",
                   help="the client on CPU 0, the peers on the others (so the peers' compute does not inflate "
                        "the client's CPU time on a small box)")
    return p.parse_args()


ARGS = parse()
os.environ["DDP_REFERENCE_HIDDEN"] = str(ARGS.hidden)
ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
       "OMP_NUM_THREADS": "1"}
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.bench.server_process import serve_collectives  # noqa: E402
from ddp_reference import batches, loss_of, make_mlp  # noqa: E402


def peer() -> tuple[subprocess.Popen, str]:
    pin = ["taskset", "-c", f"1-{os.cpu_count() - 1}"] if ARGS.pin and (os.cpu_count() or 1) > 1 else []
    return serve_collectives("torch:cpu", ENV, pin)


def train(dev: ember.Device, mesh: bool) -> tuple[float, float, float]:
    """(steps/s, client CPU seconds per step, share of the ops replayed as graphs)."""
    data = batches(ARGS.steps, ARGS.batch)
    s = dev.session
    ops0, rep0 = s.stats["ops"], s.stats["replayed_ops"]
    with dev:
        model = make_mlp().to("ember")
        if mesh:
            model = ember.torch.DataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        t0 = c0 = 0.0
        for i, (x, y) in enumerate(data):
            if i == 1:
                dev.sync()
                t0, c0 = time.perf_counter(), time.process_time()
            xs, ys = (dev.shard(x), dev.shard(y)) if mesh else (x.to("ember"), y.to("ember"))
            opt.zero_grad()
            loss_of(model, xs, ys).backward()
            opt.step()
        dev.sync()
        n = ARGS.steps - 1
        ops, rep = s.stats["ops"] - ops0, s.stats["replayed_ops"] - rep0
        return n / (time.perf_counter() - t0), (time.process_time() - c0) / n, rep / max(1, ops + rep)


def ddp() -> float:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = os.path.join(tempfile.mkdtemp(), "ref.pt")
    pin = ["taskset", "-c", f"1-{os.cpu_count() - 1}"] if ARGS.pin and (os.cpu_count() or 1) > 1 else []
    procs = [subprocess.Popen([*pin, sys.executable, str(HERE.parent / "tests" / "ddp_reference.py"), str(r), "2",
                               str(port), out, str(ARGS.steps), str(ARGS.batch)], env=ENV) for r in range(2)]
    for p in procs:
        p.wait(600)
    return float(torch.load(out)["steps_per_s"])


def main() -> None:
    procs = [peer(), peer()]
    if ARGS.pin:
        os.sched_setaffinity(0, {0})
    rows: dict[str, list[float]] = {k: [] for k in ("one", "mesh", "cpu1", "cpu2", "rep1", "rep2", "ddp")}
    try:
        addrs = [a for _, a in procs]
        one = ember.connect(addrs[0])
        t0 = time.perf_counter()
        m = ember.torch.mesh(addrs, timeout=60)
        formed = time.perf_counter() - t0
        for _ in range(ARGS.rounds):
            single, cpu1, rep1 = train(one, False)
            meshed, cpu2, rep2 = train(m, True)
            for k, v in zip(rows, (single, meshed, cpu1, cpu2, rep1, rep2, ddp())):
                rows[k].append(v)
        one.close()
        m.close()
    finally:
        for p, _ in procs:
            p.kill()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"MLP 12-{ARGS.hidden}-{ARGS.hidden}-4, global batch {ARGS.batch}, {ARGS.steps} steps a round (first not "
          f"timed), {ARGS.rounds} rounds, medians; mesh formed in {formed * 1e3:.0f} ms")
    print(f"one peer, whole batch:        {med['one']:8.2f} steps/s   (ops replayed as graphs {med['rep1']:.0%})")
    print(f"2-peer mesh, DataParallel:    {med['mesh']:8.2f} steps/s   ({med['mesh'] / med['one']:.2f}x one peer; "
          f"replayed {med['rep2']:.0%})")
    print(f"client CPU per step: one peer {med['cpu1'] * 1e3:.2f} ms, mesh {med['cpu2'] * 1e3:.2f} ms "
          f"({med['cpu2'] / med['cpu1']:.2f}x; per round {[round(b / a, 2) for a, b in zip(rows['cpu1'], rows['cpu2'])]})")
    print(f"torch DDP gloo, 2 processes:  {med['ddp']:8.2f} steps/s   (mesh / DDP = {med['mesh'] / med['ddp']:.2f})")


if __name__ == "__main__":
    main()

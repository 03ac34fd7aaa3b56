"""Values the client knows exactly (ember/torch/_known.py): reads of small integer tensors made from constants or
uploads, or computed from such, ask the peer nothing; anything that may write such a storage makes the next read
ask the peer again. Checked against local CPU torch over a real WebSocket peer, with random programs of in-place
and out-of-place integer ops, views, replays and captured steps."""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(120)


def stats(dev: ember.Device) -> tuple[int, int]:
    return dev.session.stats["known_reads"], dev.session.stats["reads"]


def packed_check(device: str) -> bool:
    """Hugging Face's packed-sequence check (masking_utils.find_packed_sequence_indices) on an arange."""
    pos = torch.arange(0, 32, device=device).unsqueeze(0).expand(8, -1)
    diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    return bool(((diff != 1).cumsum(-1)[:, -1] == 0).all())


def test_a_mask_check_on_an_arange_and_an_upload_asks_the_peer_nothing(torch_peer: str) -> None:
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    with ember.connect(torch_peer) as dev:
        assert packed_check("ember") is packed_check("cpu") is True
        e = ids.to("ember")
        assert bool((e < 64).all()) and int(e.sum()) == int(ids.sum())
        assert e[1:3, ::2].cpu().tolist() == ids[1:3, ::2].tolist()  # a view of a known storage
        assert stats(dev) == (4, 0)
        f = e.float()  # a float result: never known (its arithmetic may differ between devices)
        assert float(f.sum()) == float(ids.float().sum()) and stats(dev) == (4, 1)


def test_an_in_place_write_makes_the_next_read_ask_the_peer(torch_peer: str) -> None:
    ids = torch.arange(12).reshape(3, 4)
    with ember.connect(torch_peer) as dev:
        e = ids.to("ember")
        v = e[1]  # a view: the write through it changes the known storage
        v.add_(100)
        assert e.tolist() == [[0, 1, 2, 3], [104, 105, 106, 107], [8, 9, 10, 11]]
        assert stats(dev) == (0, 1)
        s = e.sum()  # computed after the write, from what the peer holds: not known either
        assert int(s) == 466 and stats(dev) == (0, 2)


def test_an_op_the_cpu_refuses_is_left_to_the_peer(torch_peer: str) -> None:
    with ember.connect(torch_peer) as dev:
        a = torch.tensor([6, 7], device="ember")
        q = a // torch.tensor([3, 0], device="ember")  # integer division by zero: the CPU raises, so not known
        with pytest.raises(Exception, match="ZeroDivision|division"):
            q.tolist()
        assert int(a.sum()) == 13 and stats(dev)[0] == 1


def test_a_replayed_capture_that_writes_a_known_tensor_forgets_it(torch_peer: str) -> None:
    with ember.connect(torch_peer) as dev:
        counter = torch.zeros(4, dtype=torch.int64).to("ember")

        @ember.torch.capture
        def bump(c: Any) -> None:
            c.add_(1)
        for k in range(4):
            bump(counter)
            assert counter.tolist() == [k + 1] * 4
        assert dev.session.stats["known_reads"] == 0


OPS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", lambda a, b: a + b), ("mul", lambda a, b: a * b), ("eq", lambda a, b: (a == b).to(a.dtype)),
    ("cumsum", lambda a, b: a.cumsum(0)), ("where", lambda a, b: torch.where(a > b, a, b)),
    ("flip", lambda a, b: a.flip(0)), ("cat", lambda a, b: torch.cat([a[:3], b[3:]])),
    ("masked_fill", lambda a, b: a.masked_fill(b > 5, -1)), ("clone", lambda a, b: a.clone()),
]
IN_PLACE: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add_", lambda a, b: a.add_(b)), ("mul_ view", lambda a, b: a[2:5].mul_(3)),
    ("copy_", lambda a, b: a.copy_(b)), ("fill_ view", lambda a, b: a[::2].fill_(7)),
    ("masked_fill_", lambda a, b: a.masked_fill_(b > 4, 0)), ("index_put_", lambda a, b: a.index_put_(
        (torch.tensor([1, 4], device=a.device),), torch.tensor([9, 9], device=a.device))),
]


def random_program(device: str, seed: int) -> list[Any]:
    """Integer tensors made from constants and uploads, then random ops, in place or not, and reads."""
    rng = random.Random(seed)
    pool = [torch.arange(8, device=device), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]).to(device),
            torch.zeros(8, dtype=torch.int64, device=device)]
    seen: list[Any] = []
    for _ in range(40):
        a, b = rng.choice(pool), rng.choice(pool)
        r = rng.random()
        if r < 0.45:
            name, fn = rng.choice(OPS)
            pool.append(fn(a, b))
        elif r < 0.7:
            name, fn = rng.choice(IN_PLACE)
            fn(a, b)
        elif r < 0.85:
            seen.append(a.tolist())
        else:
            seen.append(int(a[rng.randrange(8)]) + int(a.sum()))
        if len(pool) > 6:
            pool.pop(rng.randrange(3, len(pool)))
    return seen + [t.tolist() for t in pool]


def test_random_integer_programs_read_what_local_torch_computes(torch_peer: str) -> None:
    with ember.connect(torch_peer) as dev:
        for seed in range(12):
            assert random_program("ember", seed) == random_program("cpu", seed), seed
        known, reads = stats(dev)
    assert known > 20 and reads > 20, (known, reads)  # (both kinds of read happen in these programs)


def test_released_tensors_are_forgotten(torch_peer: str) -> None:
    with ember.connect(torch_peer) as dev:
        for _ in range(50):
            t = torch.arange(16, device="ember") * 2
            assert int(t[3]) == 6
        del t
        import gc
        gc.collect()
        assert len(dev.session.known) <= 2


def test_a_known_mask_cast_cloned_or_copied_from_stays_known(torch_peer: str) -> None:
    """transformers' masking code casts the uploaded attention mask (``.to(torch.bool)``) before ``.all()``; a copy
    writes its destination only, so its source stays known."""
    am = torch.ones(4, 12, dtype=torch.long)
    am[:, 9:] = 0
    with ember.connect(torch_peer) as dev:
        e = am.to("ember")
        assert not bool(e.bool().all()) and bool(e.to(torch.int32).any()) and int(e.clone().sum()) == 36
        dst = torch.zeros(4, 12, dtype=torch.long, device="ember")
        dst.copy_(e)
        assert int(e.sum()) == 36 and stats(dev) == (4, 0)
        assert int(dst.sum()) == 36 and stats(dev) == (4, 1)  # (the destination was written: the peer says)


def test_data_dependent_calls_on_known_operands_need_no_round_trip(torch_peer: str) -> None:
    """``nonzero``, ``unique``, a boolean mask's index or ``masked_select`` of a float tensor: their outputs'
    layouts depend on known values only, so they are computed here (by CPU torch, on a CPU peer) and the peer
    checks its results against them; the results equal local CPU torch, and are known when every operand is
    (diffusers' ``DDPMScheduler.previous_timestep``: ``(timesteps == t).nonzero()``)."""
    ids = torch.randint(0, 6, (8, 32), generator=torch.Generator().manual_seed(1))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    mask = ids % 3 == 0
    with ember.connect(torch_peer) as dev:
        e, xe = ids.to("ember"), x.to("ember")
        m = e % 3 == 0
        nz, u, sel, ms = m.nonzero(), torch.unique(e, return_counts=True), xe[m], torch.masked_select(xe, m)
        ts = torch.arange(999, -1, -200).to("ember")
        step = (ts == ts[2]).nonzero(as_tuple=True)[0][0]
        assert int(step) == 2 and nz.shape == mask.nonzero().shape and stats(dev) == (1, 0)
        assert nz.tolist() == mask.nonzero().tolist()
        assert u[1].tolist() == torch.unique(ids, return_counts=True)[1].tolist()
        assert stats(dev) == (3, 0)  # (every operand known: so are the results)
        assert torch.equal(sel.cpu(), x[mask]) and torch.equal(ms.cpu(), torch.masked_select(x, mask))
        assert stats(dev) == (3, 2)
        f = torch.randn(5).to("ember")
        assert torch.equal((f > 0).nonzero().cpu(), (f > 0).nonzero().cpu())  # unknown: the peer is asked


def test_an_uploaded_float_is_known_to_comparisons_only(torch_peer: str) -> None:
    """IEEE comparisons (and NaN/inf tests) of uploaded floats are exact on every device: torchdiffeq compares its
    solver's constant coefficients (``alpha_i == 1.``) every stage, a round trip each. Float arithmetic may round
    otherwise from device to device: what it makes is never known, nor a cast of a float to an integer."""
    c = torch.tensor([0.0, 0.2, 0.3, 1.0, float("nan")])
    with ember.connect(torch_peer) as dev:
        e = c.to("ember")
        hits = [bool(e[i] == 1) for i in range(4)]
        assert hits == [False, False, False, True] and bool(torch.isnan(e).any()) and not bool((e > 2).any())
        assert float(e[1]) == float(c[1]) and stats(dev) == (7, 0)
        assert float((e[:4] * 3).sum()) == float((c[:4] * 3).sum()) and stats(dev)[1] == 1  # (float arithmetic: asks)
        assert int(e[:4].to(torch.int64).sum()) == 1 and stats(dev)[1] == 2  # (a float -> int cast: asks)


def test_batch_norm_s_running_statistics_are_never_read_stale(torch_peer: str) -> None:
    """``native_batch_norm`` updates its running statistics in place, which its schema does not mark: an uploaded
    buffer (known to comparisons since floats are) must be forgotten by it, or its read would answer the upload."""
    torch.manual_seed(0)
    bn, x = torch.nn.BatchNorm1d(3), torch.randn(8, 3)
    with ember.connect(torch_peer):
        e = torch.nn.BatchNorm1d(3).to("ember")
        e(x.to("ember"))
        bn(x)
        assert torch.equal(e.running_mean.cpu(), bn.running_mean) and bool((e.running_var != 1).all())


def test_a_padding_mask_check_asks_the_peer_nothing(torch_peer: str) -> None:
    """transformers' sdpa mask check (``_ignore_causal_mask_sdpa``): the mask's columns by index, ``new_ones`` of
    a tensor whose values are not known (only its layout matters), ``sum() == numel()``."""
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 6:] = 0
    with ember.connect(torch_peer) as dev:
        mask = am.to("ember").to(torch.bool)
        cols = mask[:, torch.arange(8).to("ember")]
        act = torch.randn(3, 4).to("ember") * 2  # (computed on the peer: not known)
        one = act.new_ones((), dtype=torch.bool)
        assert not bool(cols.sum() == cols.numel()) and bool(one) and bool(cols[0].all() & one)
        assert stats(dev) == (3, 0)


def test_an_upload_forgets_its_own_id_only(torch_peer: str) -> None:
    """An upload's message carries its shape and size as integers: they were taken for ids and forgotten (a mask
    known before a step stopped being known when the step's labels were uploaded)."""
    from ember.torch._storage import ref_of
    with ember.connect(torch_peer) as dev:
        a = torch.arange(5).to("ember")
        sid = ref_of(a).sid
        torch.zeros(sid, dtype=torch.uint8).to("ember")  # (its shape and byte count both equal a's id)
        assert int(a.sum()) == 10 and stats(dev) == (1, 0)


def test_a_float_fill_is_known_and_its_bool_cast_too(torch_peer: str) -> None:
    """BART-family decoders build ``torch.ones(batch, len)`` (float) as their mask and Hugging Face checks
    ``mask.bool()`` before every forward: a fill is exact on every device, and so is a float cast to bool, so the
    check asks the peer nothing (one round trip a generated token, and a captured step run eagerly, before).
    Float arithmetic on it stays unknown."""
    with ember.connect(torch_peer) as dev:
        m = torch.ones(2, 7, device="ember")
        z = torch.zeros(3, device="ember", dtype=torch.float64)
        f = torch.full((4,), 0.1, device="ember")
        assert bool(m.bool().all()) and not bool(z.bool().any()) and bool((f == 0.1).all())
        assert torch.equal(f.cpu(), torch.full((4,), 0.1)) and torch.equal(m.cpu(), torch.ones(2, 7))
        assert stats(dev)[1] == 0
        assert float((f * 3).sum()) == float((torch.full((4,), 0.1) * 3).sum())
        assert stats(dev)[1] == 1  # (arithmetic on a float: read from the peer)

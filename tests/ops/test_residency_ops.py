"""kvoffload::residency_update and kvoffload::lightning_indexer_manage.

The C++ kernel, the reference kernel and the Triton kernel (on CPU under the Triton interpreter) are all
compared with a plain-Python model written directly from the contract (DESIGN §7 and the module docstring
of torch_kvoffload.ops.residency), on hand-made cases and on hypothesis-generated multi-step traces.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.op_impls import call_op, cpp_kernel_available, triton_device

from torch_kvoffload.ops import new_residency_outputs, new_residency_state, reference_kernel, residency_update

requires_residency_cpp = pytest.mark.skipif(
    not cpp_kernel_available("residency_update"), reason="C++ residency kernel not built"
)
# "dispatch": the C++ kernel as built (AVX2 loops on x86-64 CPUs that have AVX2); "portable": the same
# kernel with TORCH_KVOFFLOAD_RESIDENCY_SIMD=0, the code every other CPU runs; "triton": the Triton kernel
# called directly (the conftest ``op_impl`` variant of the same name).
KERNELS = ["dispatch", "portable", "reference", "triton"]
SIMD_ENV = "TORCH_KVOFFLOAD_RESIDENCY_SIMD"


@contextmanager
def _simd(enabled: bool):
    before = os.environ.get(SIMD_ENV)
    os.environ[SIMD_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[SIMD_ENV]
        else:
            os.environ[SIMD_ENV] = before


def _with_simd(fn, enabled: bool):
    def call(*args, **kwargs):
        with _simd(enabled):
            return fn(*args, **kwargs)

    return call


def _is_cpp(kernel: str) -> bool:
    return kernel in ("dispatch", "portable")


def _op(kernel: str, name: str = "residency_update"):
    if kernel == "triton":
        triton_device()  # skips when the Triton kernels cannot run here
        return lambda *args, **kwargs: call_op("triton", name, *args, **kwargs)
    if _is_cpp(kernel):
        return _with_simd(getattr(torch.ops.kvoffload, name), kernel == "dispatch")
    return reference_kernel(name)


# ------------------------------------------------------------------------------ plain-Python model


class ModelRow:
    def __init__(self, capacity: int) -> None:
        self.stt = [-1] * capacity
        self.order = list(range(capacity))
        self.request = -1


def model_update(rows, topk, request_ids, stable_len, scores, policy):
    """The contract, literally. Returns per-row (slots, miss_tokens, miss_slots, miss_count, evictions)."""
    results = []
    for r, row in enumerate(rows):
        C = len(row.stt)
        if row.request != request_ids[r]:
            row.stt, row.order, row.request = [-1] * C, list(range(C)), request_ids[r]
        row.stt = [-1 if t >= stable_len[r] else t for t in row.stt]
        where = {t: s for s, t in enumerate(row.stt) if t >= 0}
        slots, misses, hit_slots = [], [], set()
        for k, t in enumerate(topk[r]):
            if t < 0:
                slots.append(-1)
            elif t in where:
                slots.append(where[t])
                hit_slots.add(where[t])
            else:
                slots.append(None)
                misses.append(k)
        nonhit = [s for s in row.order if s not in hit_slots]
        m = len(misses)
        if policy == "lru":
            chosen = set(range(m))
        else:
            keys = []
            for i, s in enumerate(nonhit):
                t = row.stt[s]
                if t < 0:
                    keys.append((0, 0.0, i))
                    continue
                sc = scores[r][t] if t < len(scores[r]) else -math.inf
                keys.append((1, -math.inf if math.isnan(sc) else sc, i))
            chosen = {k[2] for k in sorted(keys)[:m]}
        victims = [nonhit[i] for i in range(len(nonhit)) if i in chosen]
        rest = [nonhit[i] for i in range(len(nonhit)) if i not in chosen]
        evictions = 0
        miss_tokens, miss_slots = [], []
        for j, k in enumerate(misses):
            s, t = victims[j], topk[r][k]
            evictions += row.stt[s] >= 0
            row.stt[s] = t
            slots[k] = s
            miss_tokens.append(t)
            miss_slots.append(s)
        row.order = rest + victims + [s for s in row.order if s in hit_slots]
        pad = [-1] * (len(topk[r]) - m)
        results.append((slots, miss_tokens + pad, miss_slots + pad, m, evictions))
    return results


def _run(kernel, state, topk, req, stable, scores, policy):
    R, K = topk.shape
    out = new_residency_outputs(R, K)
    _op(kernel)(*state, topk, req, stable, scores, policy, *out.as_tuple())
    return out


def _compare(rows, state, out, expected) -> None:
    stt, lru, row_req = state
    for r, row in enumerate(rows):
        assert stt[r].tolist() == row.stt, f"slot_to_token row {r}"
        assert lru[r].tolist() == row.order, f"lru_order row {r}"
        assert int(row_req[r]) == row.request
        slots, mt, ms, mc, ev = expected[r]
        assert out.slots[r].tolist() == slots, f"slots row {r}"
        assert out.miss_tokens[r].tolist() == mt
        assert out.miss_slots[r].tolist() == ms
        assert int(out.miss_count[r]) == mc
        assert int(out.evictions[r]) == ev


def _invariants(state, out, topk) -> None:
    stt, _, _ = state
    for r in range(stt.shape[0]):
        tokens = [t for t in stt[r].tolist() if t >= 0]
        assert len(tokens) == len(set(tokens)), "a token holds two slots"
        for k, t in enumerate(topk[r].tolist()):
            s = int(out.slots[r, k])
            if t < 0:
                assert s == -1
            else:
                assert int(stt[r, s]) == t, "a top-k entry does not point at its token"


# ------------------------------------------------------------------------------------ hand cases


@pytest.mark.parametrize("kernel", KERNELS)
def test_lru_worked_example(kernel: str) -> None:
    """C = 4, K = 2: explicit expected slots, misses, order and evictions over three steps."""
    state = new_residency_state(1, 4)
    req, stable = torch.tensor([7]), torch.tensor([100])
    step = lambda tk: _run(kernel, state, torch.tensor([tk], dtype=torch.int32), req, stable, None, "lru")  # noqa: E731
    out = step([10, 11])  # misses take slots 0, 1 (LRU order 0..3)
    assert out.slots.tolist() == [[0, 1]] and out.miss_count.tolist() == [2] and out.evictions.tolist() == [0]
    assert state[1].tolist() == [[2, 3, 0, 1]]
    out = step([11, 12])  # 11 hits slot 1, 12 takes slot 2
    assert out.slots.tolist() == [[1, 2]] and out.miss_tokens.tolist() == [[12, -1]]
    assert state[1].tolist() == [[3, 0, 2, 1]]
    out = step([13, 14])  # misses take slots 3 (empty) and 0 (holds 10: eviction)
    assert out.slots.tolist() == [[3, 0]] and out.evictions.tolist() == [1]
    assert state[0].tolist() == [[14, 11, 12, 13]]
    assert state[1].tolist() == [[2, 1, 3, 0]]


@pytest.mark.parametrize("kernel", KERNELS)
def test_reset_and_stable_prefix(kernel: str) -> None:
    stt = torch.tensor([[5, 6, 7, 8]], dtype=torch.int32)
    lru = torch.tensor([[3, 2, 1, 0]], dtype=torch.int32)
    state = (stt, lru, torch.tensor([1]))
    topk = torch.tensor([[5, 7]], dtype=torch.int32)
    # stable_len 7: token 7 (slot 2) and 8 (slot 3) are dropped, 5 hits, 7 misses into LRU slot 3
    out = _run(kernel, state, topk, torch.tensor([1]), torch.tensor([7]), None, "lru")
    assert out.slots.tolist() == [[0, 3]] and out.evictions.tolist() == [0]
    assert stt.tolist() == [[5, 6, -1, 7]]
    assert lru.tolist() == [[2, 1, 3, 0]]
    # a new request resets the row: everything misses
    out = _run(kernel, state, topk, torch.tensor([2]), torch.tensor([100]), None, "lru")
    assert out.miss_count.tolist() == [2] and out.slots.tolist() == [[0, 1]]
    assert state[2].tolist() == [2]


@pytest.mark.parametrize("kernel", KERNELS)
def test_score_policy_evicts_lowest_score(kernel: str) -> None:
    stt = torch.tensor([[0, 1, 2, -1, 3]], dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32)
    state = (stt, lru, torch.tensor([1]))
    scores = torch.tensor([[0.5, -1.0, 2.0, float("nan"), 9.0]])  # token 3 has NaN: counts as -inf
    topk = torch.tensor([[2, 8, 9, 10]], dtype=torch.int32)  # 2 hits; three misses
    out = _run(kernel, state, topk, torch.tensor([1]), torch.tensor([50]), scores, "score")
    # victims: empty slot 3 first, then token 3 (NaN = -inf, slot 4), then token 1 (slot 1);
    # assigned to misses in LRU order: slot 1, slot 3, slot 4
    assert out.slots.tolist() == [[2, 1, 3, 4]]
    assert out.evictions.tolist() == [2]
    assert stt.tolist() == [[0, 8, 2, 9, 10]]
    assert lru.tolist() == [[0, 1, 3, 4, 2]]


@pytest.mark.parametrize("kernel", KERNELS)
def test_padding_and_empty_shapes(kernel: str) -> None:
    state = new_residency_state(2, 3)
    topk = torch.full((2, 3), -1, dtype=torch.int32)
    out = _run(kernel, state, topk, torch.tensor([0, 1]), torch.tensor([5, 5]), None, "lru")
    assert out.slots.eq(-1).all() and out.miss_count.tolist() == [0, 0]
    empty = new_residency_state(0, 4)
    _run(kernel, empty, torch.empty(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.int64),
         torch.empty(0, dtype=torch.int64), None, "lru")  # fmt: skip
    zero_k = new_residency_state(2, 4)
    out = _run(kernel, zero_k, torch.empty(2, 0, dtype=torch.int32), torch.tensor([3, 4]),
               torch.tensor([1, 1]), None, "lru")  # fmt: skip
    assert zero_k[2].tolist() == [3, 4]


@pytest.mark.parametrize("policy", ["lru", "score"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_inputs_read_like_contiguous_ones(kernel: str, policy: str) -> None:
    """Read-only inputs may be views (every other column / entry): same result as contiguous copies."""
    R, C, K = 3, 16, 6
    topk = torch.stack([torch.randperm(40)[: 2 * K] for _ in range(R)]).to(torch.int32)[:, ::2]
    req = torch.tensor([1, 9, 2, 9, 3, 9])[::2]
    stable = torch.tensor([30, 0, 30, 0, 30, 0])[::2]
    scores = torch.randn(R, 80)[:, ::2]
    strided, contiguous = new_residency_state(R, C), new_residency_state(R, C)
    a = _run(kernel, strided, topk, req, stable, scores, policy)
    b = _run(kernel, contiguous, topk.contiguous(), req.contiguous(), stable.contiguous(), scores.contiguous(),
             policy)  # fmt: skip
    for x, y in zip(strided + a.as_tuple(), contiguous + b.as_tuple(), strict=True):
        assert torch.equal(x, y)
    assert int(a.miss_count.sum()) == R * K  # fresh rows: every entry misses


# ------------------------------------------------------------------------------ property tests


@st.composite
def traces(draw):
    R = draw(st.integers(1, 3))
    C = draw(st.integers(1, 20))  # the AVX2 loops take 8 slots per step, then a scalar tail
    K = draw(st.integers(0, C))
    positions = draw(st.integers(1, 3 * C + 2))
    steps = draw(st.integers(1, 6))
    policy = draw(st.sampled_from(["lru", "score"]))
    # positions >= 2**21 take the C++ kernel's hash path instead of its direct-address table
    offset = draw(st.sampled_from([0, 0, 1 << 30]))
    seq = []
    for _ in range(steps):
        topk = []
        for _r in range(R):
            n = draw(st.integers(0, min(K, positions)))
            toks = draw(st.lists(st.integers(0, positions - 1), min_size=n, max_size=n, unique=True))
            row = [t + offset for t in toks] + [-1] * (K - n)
            topk.append(draw(st.permutations(row)) if K else [])
        req = [draw(st.integers(-1, 2)) for _ in range(R)]
        stable = [offset + draw(st.integers(0, positions + 1)) for _ in range(R)]
        scores = [
            [draw(st.sampled_from([0.0, 1.0, -2.0, 3.5, float("nan")])) for _ in range(positions - 1)]
            for _ in range(R)
        ]  # one short of the positions: the last position counts as -inf
        seq.append((topk, req, stable, scores))
    return R, C, K, policy, seq


@pytest.mark.parametrize("kernel", ["dispatch", "portable", "reference"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_matches_model_on_random_traces(kernel: str, trace) -> None:
    if _is_cpp(kernel) and not cpp_kernel_available("residency_update"):
        pytest.skip("C++ residency kernel not built")
    _check_trace(kernel, trace)


@pytest.mark.slow  # the Triton interpreter over five random traces
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_triton_matches_model_on_random_traces(trace) -> None:
    """Fewer examples: the interpreter runs a row's sorts in numpy, about a second per call."""
    _check_trace("triton", trace)


def _check_trace(kernel: str, trace) -> None:
    R, C, K, policy, seq = trace
    rows = [ModelRow(C) for _ in range(R)]
    state = new_residency_state(R, C)
    for topk, req, stable, scores in seq:
        tk = torch.tensor(topk, dtype=torch.int32).reshape(R, K)
        sc = torch.tensor(scores, dtype=torch.float32).reshape(R, -1)
        out = _run(kernel, state, tk, torch.tensor(req), torch.tensor(stable), sc, policy)
        expected = model_update(rows, topk, req, stable, scores, policy)
        _compare(rows, state, out, expected)
        _invariants(state, out, tk)


SCALE_CASES = (
    [
        pytest.param(
            kernel, policy, offset, (8, 512, 256, 1500, 20), id=f"R8-C512-K256-{kernel}-{policy}-{offset}"
        )
        for kernel in ("dispatch", "portable")
        for policy in ("lru", "score")
        for offset in (0, 1 << 29)
    ]
    + [  # K > 2048: 32-bit position table entries
        pytest.param(kernel, policy, 0, (1, 65600, 65535, 140000, 2), id=f"K65535-{kernel}-{policy}")
        for kernel, policy in (("dispatch", "lru"), ("dispatch", "score"), ("portable", "lru"))
    ]
    + [  # the largest K with 16-bit entries, and the smallest with 32-bit ones
        pytest.param(kernel, "lru", 0, (2, 2100, k, 9000, 3), id=f"K{k}-{kernel}")
        for kernel in ("dispatch", "portable")
        for k in (2048, 2049)
    ]
)


@requires_residency_cpp
@pytest.mark.parametrize(("kernel", "policy", "offset", "shape"), SCALE_CASES)
def test_cpp_matches_reference_at_scale(kernel: str, policy: str, offset: int, shape) -> None:
    """Heavy reuse over several steps, with row resets and speculative rewrites."""
    R, C, K, L, steps = shape
    a, b = new_residency_state(R, C), new_residency_state(R, C)
    req = torch.arange(R, dtype=torch.int64)
    for step in range(steps):
        if step % 7 == 6:
            req[step % R] += 100  # a finished request's row taken by a new one
        scores = torch.randn(R, L)
        topk = torch.stack([torch.randperm(L // 2 + 40 * step)[:K] for _ in range(R)]).to(torch.int32)
        topk += offset
        topk[:, -5:] = -1
        stable = torch.randint(L // 2, L, (R,)) + offset
        oa = _run(kernel, a, topk, req, stable, scores, policy)
        ob = _run("reference", b, topk, req, stable, scores, policy)
        for x, y in zip(a + oa.as_tuple(), b + ob.as_tuple(), strict=True):
            assert torch.equal(x, y)
        _invariants(a, oa, topk)


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_triton_matches_reference_over_steps(policy: str) -> None:
    """Rows wider than one tile of 16 (C = 40, K = 24), reuse over steps, resets and rewrites, large
    positions: the Triton kernel equals the reference kernel on every output and state tensor."""
    R, C, K, L = 2, 40, 24, 100
    a, b = new_residency_state(R, C), new_residency_state(R, C)
    req = torch.arange(R, dtype=torch.int64)
    for step in range(3):
        if step == 2:
            req[1] += 100  # a new request takes row 1
        scores = torch.randn(R, L)
        scores[:, ::9] = float("nan")
        topk = torch.stack([torch.randperm(L // 2 + 20 * step)[:K] for _ in range(R)]).to(torch.int32)
        topk[0] += 1 << 30
        topk[:, -3:] = -1
        stable = torch.randint(L // 2, L, (R,))
        stable[0] += 1 << 30
        oa = _run("triton", a, topk, req, stable, scores, policy)
        ob = _run("reference", b, topk, req, stable, scores, policy)
        for x, y in zip(a + oa.as_tuple(), b + ob.as_tuple(), strict=True):
            assert torch.equal(x, y)
        _invariants(a, oa, topk)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["lru", "score"])
def test_cuda_matches_reference_over_steps(policy: str) -> None:
    """The registered CUDA kernel on device tensors (R = 8, C = 512, K = 256, resets, rewrites) equals
    the reference kernel on CPU copies of the same inputs."""
    R, C, K, L = 8, 512, 256, 1500
    dev = new_residency_state(R, C, "cuda")
    ref = new_residency_state(R, C)
    req = torch.arange(R, dtype=torch.int64)
    for step in range(4):
        if step == 2:
            req[3] += 100
        scores = torch.randn(R, L)
        topk = torch.stack([torch.randperm(L // 2 + 40 * step)[:K] for _ in range(R)]).to(torch.int32)
        topk[:, -5:] = -1
        stable = torch.randint(L // 2, L, (R,))
        out_dev = new_residency_outputs(R, K, "cuda")
        torch.ops.kvoffload.residency_update(
            *dev, topk.cuda(), req.cuda(), stable.cuda(), scores.cuda(), policy, *out_dev.as_tuple()
        )
        out_ref = _run("reference", ref, topk, req, stable, scores, policy)
        for x, y in zip(dev + out_dev.as_tuple(), ref + out_ref.as_tuple(), strict=True):
            assert torch.equal(x.cpu(), y)


@requires_residency_cpp
@pytest.mark.parametrize("kernel", ["dispatch", "portable"])
@pytest.mark.parametrize("K", [300, 2100])
def test_cpp_after_the_position_table_tags_run_out(kernel: str, K: int) -> None:
    """Each row of a thread tags its position-table entries anew and the table is zeroed when the tags run
    out (31 of them with 16-bit entries, K <= 2048; 4095 with 32-bit ones), up to the highest position
    written since the last zeroing. Rows past several such wrap-arounds, on one thread, with positions
    that grow and shrink between rows, still equal the reference."""
    C, L = K + 64, 4 * K
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        R = 64
        a, b = new_residency_state(R, C), new_residency_state(R, C)
        req = torch.arange(R, dtype=torch.int64)
        stable = torch.full((R,), 64 * L, dtype=torch.int64)
        g = torch.Generator().manual_seed(K)
        burn = new_residency_state(R, C)
        for step in range(4):
            # drive this thread's tags through a wrap-around between compared steps; some rows reach far
            for i in range(70 if K > 2048 else 1):
                tk = torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(R)]).to(torch.int32)
                tk[i % 5 :: 5] += 40 * L
                _run(kernel, burn, tk, req, stable, None, "lru")
            topk = torch.stack([torch.randperm(L // 2 + 50 * step, generator=g)[:K] for _ in range(R)])
            topk = topk.to(torch.int32) + (40 * L if step % 2 else 0)
            oa = _run(kernel, a, topk, req, stable, None, "lru")
            ob = _run("reference", b, topk, req, stable, None, "lru")
            for x, y in zip(a + oa.as_tuple(), b + ob.as_tuple(), strict=True):
                assert torch.equal(x, y)
    finally:
        torch.set_num_threads(prev)


# ------------------------------------------------------------------------------- opcheck, compile


def _opcheck_args(policy: str):
    R, C, K = 3, 16, 6
    stt, lru, req = new_residency_state(R, C)
    stt[:, :8] = torch.arange(8, dtype=torch.int32)
    req[:] = torch.tensor([0, 1, 2])
    topk = torch.stack([torch.randperm(20)[:K] for _ in range(R)]).to(torch.int32)
    scores = torch.randn(R, 20) if policy == "score" else None
    out = new_residency_outputs(R, K)
    return (stt, lru, req, topk, torch.tensor([0, 1, 5]), torch.tensor([20, 4, 20]), scores, policy,
            *out.as_tuple())  # fmt: skip


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_opcheck(policy: str) -> None:
    torch.library.opcheck(torch.ops.kvoffload.residency_update.default, _opcheck_args(policy))


def test_compile_fullgraph() -> None:
    def step(stt, lru, req, topk, ids, stable, scores, slots, mt, ms, mc, ev):
        torch.ops.kvoffload.residency_update(stt, lru, req, topk, ids, stable, scores, "score",
                                             slots, mt, ms, mc, ev)  # fmt: skip
        return mc, ev

    args = _opcheck_args("score")
    args = args[:7] + args[8:]
    eager = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    compiled = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    expected = step(*eager)
    got = torch.compile(step, fullgraph=True, backend="inductor")(*compiled)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    for x, y in zip(compiled, eager, strict=True):
        assert torch.equal(x, y)


# --------------------------------------------------------------------------------------- errors


def _base():
    R, C, K = 2, 6, 3
    stt = torch.tensor([[0, 1, 2, -1, -1, -1], [4, 5, -1, -1, -1, -1]], dtype=torch.int32)
    lru = torch.arange(C, dtype=torch.int32).repeat(R, 1)
    req = torch.tensor([1, 2])
    topk = torch.tensor([[0, 3, -1], [4, 7, 8]], dtype=torch.int32)
    out = new_residency_outputs(R, K)
    for t in out.as_tuple():
        t.fill_(-7)
    return dict(
        slot_to_token=stt, lru_order=lru, row_request=req, topk=topk, request_ids=torch.tensor([1, 2]),
        stable_len=torch.tensor([10, 10]), scores=torch.randn(R, 10), policy="lru",
        slots=out.slots, miss_tokens=out.miss_tokens, miss_slots=out.miss_slots,
        miss_count=out.miss_count, evictions=out.evictions,
    )  # fmt: skip


def _set(**kw):
    def build(a):
        for k, v in kw.items():
            a[k] = v(a) if callable(v) else v
        return a

    return build


ERROR_CASES = [
    (_set(topk=lambda a: torch.tensor([[0, 3, 0], [4, 7, 8]], dtype=torch.int32)), ValueError,
     "'topk' row 0 holds position 0 more than once"),
    (_set(topk=lambda a: torch.zeros(2, 7, dtype=torch.int32)), ValueError, "K = 7 .* capacity C = 6"),
    (_set(topk=lambda a: a["topk"].long()), TypeError, "'topk' must have dtype torch.int32"),
    (_set(topk=lambda a: a["topk"][:1]), ValueError, "'topk' must have R = 2 rows"),
    (_set(lru_order=lambda a: torch.zeros(2, 6, dtype=torch.int32)), ValueError,
     "'lru_order' row 0 is not a permutation"),
    (_set(lru_order=lambda a: a["lru_order"][:, :5].contiguous()), ValueError, "'lru_order' must have shape"),
    (_set(slot_to_token=lambda a: torch.tensor([[0, 1, 2, -1, -1, -1], [4, 4, -1, -1, -1, -1]],
                                               dtype=torch.int32)), ValueError,
     "'slot_to_token' row 1 holds top-k position 4 in two slots"),
    (_set(slot_to_token=lambda a: torch.tensor([[0, 1, -3, -1, -1, -1], [4, 5, -1, -1, -1, -1]],
                                               dtype=torch.int32)), ValueError,
     "'slot_to_token' row 0 slot 2 holds -3"),
    (_set(stable_len=torch.tensor([10, -1])), ValueError, "'stable_len' entry 1 is -1"),
    (_set(stable_len=torch.tensor([10, 1], dtype=torch.int32)), TypeError, "'stable_len' must have dtype"),
    (_set(request_ids=torch.tensor([1])), ValueError, "'request_ids' must have shape"),
    (_set(policy="mru"), ValueError, "'policy' must be one of"),
    (_set(policy="score", scores=None), ValueError, "'scores' is required with policy 'score'"),
    (_set(policy="score", scores=lambda a: a["scores"].double()), TypeError, "'scores' must have dtype"),
    (_set(slots=lambda a: torch.zeros(2, 4, dtype=torch.int32)), ValueError, "'slots' must have shape"),
    (_set(miss_count=lambda a: torch.zeros(2, dtype=torch.int64)), TypeError, "'miss_count' must have dtype"),
    (_set(slot_to_token=lambda a: a["slot_to_token"].t().contiguous().t()), ValueError,
     "'slot_to_token' must be contiguous"),
]  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: c[2][:40])
def test_bad_input_raises_and_leaves_everything_untouched(case, kernel: str) -> None:
    build, exc, fragment = case
    args = build(_base())
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=f"kvoffload::residency_update: .*{fragment}"):
        _op(kernel)(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v), f"{k} modified by a rejected call"


def _wide_base():
    """R = 2, C = 27, K = 10: rows long enough for the 8-slot AVX2 steps plus a scalar tail."""
    R, C, K = 2, 27, 10
    stt = torch.full((R, C), -1, dtype=torch.int32)
    stt[:, :20] = torch.arange(100, 120, dtype=torch.int32)
    lru = torch.stack([torch.randperm(C, generator=torch.Generator().manual_seed(r)) for r in range(R)])
    topk = torch.stack([torch.arange(105, 115), torch.arange(110, 120)]).to(torch.int32)
    out = new_residency_outputs(R, K)
    for t in out.as_tuple():
        t.fill_(-7)
    return dict(
        slot_to_token=stt, lru_order=lru.to(torch.int32), row_request=torch.tensor([1, 2]), topk=topk,
        request_ids=torch.tensor([1, 2]), stable_len=torch.tensor([200, 200]), scores=None, policy="lru",
        slots=out.slots, miss_tokens=out.miss_tokens, miss_slots=out.miss_slots,
        miss_count=out.miss_count, evictions=out.evictions,
    )  # fmt: skip


def _put(name, row, col, value):
    def build(a):
        a[name] = a[name].clone()
        a[name][row, col] = value
        return a

    return build


WIDE_ERROR_CASES = [
    (_put("slot_to_token", 1, 17, 112), "'slot_to_token' row 1 holds top-k position 112 in two slots"),
    (_put("slot_to_token", 0, 25, 107), "'slot_to_token' row 0 holds top-k position 107 in two slots"),
    (_put("slot_to_token", 1, 9, -4), "'slot_to_token' row 1 slot 9 holds -4"),
    (_put("slot_to_token", 0, 26, -2), "'slot_to_token' row 0 slot 26 holds -2"),
    (_put("topk", 1, 9, 111), "'topk' row 1 holds position 111 more than once"),
    (_put("lru_order", 0, 12, 27), "'lru_order' row 0 is not a permutation"),
    (_put("lru_order", 1, 3, -1), "'lru_order' row 1 is not a permutation"),
    (lambda a: _put("lru_order", 1, 20, int(a["lru_order"][1, 4]))(a), "'lru_order' row 1 is not a permutation"),
]  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", WIDE_ERROR_CASES, ids=lambda c: c[1][:48])
def test_bad_wide_rows_raise_and_leave_everything_untouched(case, kernel: str) -> None:
    build, fragment = case
    good = _wide_base()
    _op(kernel)(**good)  # the base itself is valid
    args = build(_wide_base())
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=f"kvoffload::residency_update: .*{fragment}"):
        _op(kernel)(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v), f"{k} modified by a rejected call"


def test_public_wrapper_returns_outputs() -> None:
    stt, lru, req = new_residency_state(2, 8)
    out = new_residency_outputs(2, 4)
    topk = torch.tensor([[0, 5, 9, -1], [3, 1, 2, 7]], dtype=torch.int32)
    res = residency_update(
        stt, lru, req, topk, torch.tensor([10, 11]), torch.tensor([10, 8]), None, "lru", out
    )
    assert res is out and res.miss_count.tolist() == [3, 4]


# ------------------------------------------------------------------------- lightning_indexer_manage


def _lim_args(policy: str, T: int = 4, K: int = 6, C: int = 10):
    g = torch.Generator().manual_seed(2)
    nb, bs, D = 12, 4, 16
    stt, lru, req = new_residency_state(T, C)
    topk = torch.empty(T, K, dtype=torch.int32)
    out = new_residency_outputs(T, K)
    return dict(
        q=torch.randn(T, 2, D, generator=g), weights=torch.randn(T, 2, generator=g),
        k_cache=torch.randn(nb, bs, D, generator=g),
        block_table=torch.randperm(nb, generator=g)[: T * 3].view(T, 3).to(torch.int32),
        cu_seqlens_q=torch.arange(T + 1, dtype=torch.int32), seq_lens_k=torch.tensor([2, 5, 9, 12][:T], dtype=torch.int32),
        slot_to_token=stt, lru_order=lru, row_request=req, request_ids=torch.arange(T),
        stable_len=torch.tensor([2, 5, 9, 12][:T]), policy=policy, topk=topk, slots=out.slots,
        miss_tokens=out.miss_tokens, miss_slots=out.miss_slots, miss_count=out.miss_count, evictions=out.evictions,
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["lru", "score"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_lim_equals_indexer_then_update(policy: str, kernel: str) -> None:
    a = _lim_args(policy)
    _op(kernel, "lightning_indexer_manage")(**a)
    idx = (a["q"], a["weights"], a["k_cache"], a["block_table"], a["cu_seqlens_q"], a["seq_lens_k"])
    want = torch.ops.kvoffload.lightning_indexer(*idx, a["topk"].shape[1])
    assert torch.equal(a["topk"], want) and bool((want == -1).any())  # short rows are padded
    scores = torch.ops.kvoffload.lightning_indexer_scores(*idx)
    state = new_residency_state(*a["slot_to_token"].shape)
    out = _run("reference", state, want, a["request_ids"], a["stable_len"], scores, policy)
    assert torch.equal(a["slots"], out.slots) and torch.equal(a["miss_tokens"], out.miss_tokens)
    assert torch.equal(a["slot_to_token"], state[0]) and torch.equal(a["lru_order"], state[1])


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_lim_opcheck(policy: str) -> None:
    torch.library.opcheck(torch.ops.kvoffload.lightning_indexer_manage.default, (), _lim_args(policy))


def test_lim_compile_fullgraph() -> None:
    def step(a):
        torch.ops.kvoffload.lightning_indexer_manage(**a)
        return a["miss_count"], a["topk"]

    eager, compiled = _lim_args("score"), _lim_args("score")
    expected = step(eager)
    got = torch.compile(step, fullgraph=True, backend="inductor")(compiled)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    for k, v in eager.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(compiled[k], v), k


LIM_ERRORS = [
    (dict(policy="mru"), ValueError, "'policy' must be one of"),
    (dict(topk=torch.empty(4, 12, dtype=torch.int32)), ValueError, "K = 12 .* capacity C = 10"),
    (dict(request_ids=torch.arange(3)), ValueError, "'request_ids' must have shape"),
    (dict(lru_order=torch.zeros(4, 10, dtype=torch.int32), row_request=torch.arange(4)), ValueError,
     "'lru_order' row 0 is not a permutation"),
    (dict(seq_lens_k=torch.tensor([2, 5, 9, 13], dtype=torch.int32)), Exception, "seq_lens_k"),  # indexer rejects
]  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", LIM_ERRORS, ids=lambda c: c[2][:30])
def test_lim_bad_input_leaves_state_untouched(case, kernel: str) -> None:
    change, exc, fragment = case
    a = _lim_args("lru")
    a.update(change)
    for t in (a["topk"], a["slots"], a["miss_tokens"], a["miss_slots"], a["miss_count"], a["evictions"]):
        t.fill_(-7)
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=fragment):
        _op(kernel, "lightning_indexer_manage")(**a)
    for k, v in before.items():
        assert torch.equal(a[k], v), f"{k} modified by a rejected call"


@requires_residency_cpp
def test_rejected_rows_leave_no_trace_in_later_calls() -> None:
    """After duplicate-position / duplicate-resident errors the kernel's lookup tables are clean again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same worker thread serves every call
    try:
        for bad in (
            _set(topk=lambda a: torch.tensor([[5, 3, 5], [4, 7, 8]], dtype=torch.int32)),
            _set(
                slot_to_token=lambda a: torch.tensor(
                    [[0, 1, 2, -1, -1, -1], [4, 4, -1, -1, -1, -1]], dtype=torch.int32
                )
            ),
        ):
            with pytest.raises(ValueError):
                _op("dispatch")(**bad(_base()))
            good_a, good_b = _base(), _base()
            good_a["topk"] = good_b["topk"] = torch.tensor([[3, 5, 0], [7, 4, 8]], dtype=torch.int32)
            good_b["scores"] = good_a["scores"]
            _op("dispatch")(**good_a)
            _op("reference")(**good_b)
            for k, v in good_a.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, good_b[k]), k
    finally:
        torch.set_num_threads(threads)

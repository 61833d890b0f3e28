"""Triton kernels compiled for CUDA sm_90 without a GPU, and the one-pass indexer scores + top-k.

The compile check runs ``benchmarks/triton_compile_check.py``'s small cases (every launched kernel at the
smallest constexprs its launcher picks) through ``triton.compile`` and ``ptxas``, in a subprocess without
``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions at import). It catches what the
interpreter accepts and the compiler rejects, such as an int8 ``tl.dot`` with a reduction dim below 32.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.op_impls import run_triton

from torch_kvoffload.ops import reference_kernel
from torch_kvoffload.ops.triton import triton_available

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "triton_compile_check.py"
TARGET = 90


def _load_check():
    spec = importlib.util.spec_from_file_location("triton_compile_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


check = _load_check()

requires_triton = pytest.mark.skipif(not triton_available(), reason="triton is not importable")
requires_ptxas = pytest.mark.skipif(
    not (triton_available() and check.ptxas_available()),
    reason="triton's CUDA backend (ptxas, shipped with the triton wheel) is not available",
)

SMALL = [c for c in check.compile_cases() if c.size == "small"]
_INT8 = next(c for c in SMALL if c.kernel == "indexer._scores_kernel" and c.constexprs["QUANT"])
#: The int8 scores case with a 16-wide reduction: the interpreter runs it, the CUDA compiler must refuse.
INT8_K16 = dataclasses.replace(
    _INT8, label="int8 H16 D16 (invalid)", constexprs={**_INT8.constexprs, "BLOCK_D": 16}
)

_DRIVER = textwrap.dedent(
    """
    import dataclasses, importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("triton_compile_check", sys.argv[1])
    check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check
    spec.loader.exec_module(check)
    cases = [check.Case(**c) for c in json.loads(sys.argv[2])]
    rows = check.run(cases, (int(sys.argv[3]),))
    with open(sys.argv[4], "w") as f:
        json.dump(rows, f)
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """Result row of every small case (and the invalid int8 one) compiled for sm_90, by (kernel, label)."""
    out = tmp_path_factory.mktemp("compile") / "rows.json"
    cases = json.dumps([dataclasses.asdict(c) for c in [*SMALL, INT8_K16]])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(SCRIPT), cases, str(TARGET), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return {(r["kernel"], r["case"]): r for r in json.loads(out.read_text())}


@requires_triton
def test_every_launched_kernel_has_a_small_compile_case() -> None:
    launched = check.launched_kernels()
    # the ten ops launch these eight kernels; a new kernel must get a compile case
    assert len(launched) >= 8, launched
    assert launched <= {c.kernel for c in SMALL}
    assert {c.kernel for c in check.compile_cases()} <= launched  # no case for a kernel that is gone


@requires_ptxas
@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"{c.kernel}[{c.label}]")
def test_kernel_compiles_for_sm90(case, compiled) -> None:
    row = compiled[(case.kernel, case.label)]
    assert row["ok"], row.get("error")
    assert row["target"] == f"sm_{TARGET}"
    if "registers" in row:  # cuobjdump present: the cubin is a real sm_90 function
        assert 0 < row["registers"] <= 255


@requires_ptxas
def test_compile_check_rejects_an_int8_dot_with_a_short_reduction(compiled) -> None:
    row = compiled[(INT8_K16.kernel, INT8_K16.label)]
    assert not row["ok"] and "K >= 32" in row["error"], row


# -------------------------------------------------------------------- one-pass indexer scores + top-k


def _indexer_case(T: int, H: int, D: int, block_size: int, lens: list[int], q_lens: list[int], dtype):
    B = len(lens)
    max_blocks = max(1, -(-max(lens) // block_size)) + 1  # one spare column: the width exceeds every length
    nb = B * max_blocks + 2
    q = torch.randn(T, H, D).to(dtype)
    w = torch.randn(T, H)
    k = torch.randn(nb, block_size, D).to(dtype)
    table = torch.randperm(nb)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    assert cu[-1] == T
    return q, w, k, table, cu, torch.tensor(lens, dtype=torch.int32)


INDEXER_CASES = [
    # T, H, D, block_size, seq_lens_k, queries per request, top_k, dtype
    (3, 4, 32, 16, [20, 40], [2, 1], 25, torch.float32),
    (5, 2, 16, 8, [7, 30, 0], [3, 2, 0], 8, torch.float32),
    (2, 3, 64, 4, [9], [2], 50, torch.bfloat16),  # top_k beyond the width: padded
    (4, 1, 16, 16, [3, 50], [1, 3], 0, torch.float32),
]


@requires_triton
@pytest.mark.parametrize("case", INDEXER_CASES)
def test_scores_topk_equals_both_reference_ops(case) -> None:
    from torch_kvoffload.ops.triton.indexer import lightning_indexer_scores_topk

    T, H, D, bs, lens, q_lens, top_k, dtype = case
    args = _indexer_case(T, H, D, bs, lens, q_lens, dtype)
    scores, topk = run_triton(lightning_indexer_scores_topk, *args, top_k)
    want_scores = reference_kernel("lightning_indexer_scores")(*args)
    want_topk = reference_kernel("lightning_indexer")(*args, top_k)
    assert scores.dtype == torch.float32 and scores.shape == want_scores.shape
    assert torch.equal(torch.isinf(scores), torch.isinf(want_scores))  # −inf past each visible length
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(scores, want_scores, **tol)
    assert topk.dtype == torch.int32 and topk.shape == (T, top_k)
    assert torch.equal(topk == -1, want_topk == -1)  # the same padding
    # the same selection up to rounding (a near tie may swap two positions on another device)
    for t in range(T):
        got = want_scores[t][topk[t][topk[t] >= 0].long()].sort().values
        exp = want_scores[t][want_topk[t][want_topk[t] >= 0].long()].sort().values
        torch.testing.assert_close(got, exp, **tol)
    # the top-k is the one of the returned scores (same pass): ranking them reproduces it
    for t in range(T):
        row = scores[t].tolist()
        n = int((~torch.isinf(scores[t])).sum())
        order = sorted(range(n), key=lambda s, r=row: (-r[s], s))[:top_k]
        assert topk[t].tolist() == order + [-1] * (top_k - len(order))


@requires_triton
def test_scores_topk_rejects_bad_input_like_lightning_indexer() -> None:
    from torch_kvoffload.ops.triton.indexer import lightning_indexer_scores_topk

    q, w, k, table, cu, lens = _indexer_case(3, 4, 32, 16, [20, 40], [2, 1], torch.float32)
    with pytest.raises(ValueError, match=r"kvoffload::lightning_indexer: argument 'top_k' must be >= 0"):
        run_triton(lightning_indexer_scores_topk, q, w, k, table, cu, lens, -1)
    with pytest.raises(TypeError, match="kvoffload::lightning_indexer: 'q' and 'k_cache' must have the same"):
        run_triton(lightning_indexer_scores_topk, q, w, k.double(), table, cu, lens, 4)
    bad_lens = torch.tensor([20, 10_000], dtype=torch.int32)
    with pytest.raises(ValueError, match="argument 'seq_lens_k' entry 1 is 10000"):
        run_triton(lightning_indexer_scores_topk, q, w, k, table, cu, bad_lens, 4)


@requires_triton
@pytest.mark.parametrize("policy", ["lru", "score"])
def test_lightning_indexer_manage_scores_once(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One indexer scoring pass per call for either policy, and the op's outputs unchanged."""
    from torch_kvoffload.ops.residency import new_residency_outputs, new_residency_state
    from torch_kvoffload.ops.triton import indexer, triton_kernel

    launches = []
    real = indexer._launch_scores
    monkeypatch.setattr(indexer, "_launch_scores", lambda *a: launches.append(1) or real(*a))
    T, K, C = 4, 6, 10
    q, w, k, table, cu, lens = _indexer_case(T, 2, 16, 4, [2, 5, 9, 12], [1, 1, 1, 1], torch.float32)

    def args():
        stt, lru, req = new_residency_state(T, C)
        out = new_residency_outputs(T, K)
        return [
            q, w, k, table, cu, lens, stt, lru, req, torch.arange(T), torch.tensor([2, 5, 9, 12]), policy,
            torch.empty(T, K, dtype=torch.int32), *out.as_tuple(),
        ]  # fmt: skip

    got, want = args(), args()
    run_triton(triton_kernel("lightning_indexer_manage"), *got)
    assert len(launches) == 1
    reference_kernel("lightning_indexer_manage")(*want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"argument {i} differs from the reference"


@requires_triton
def test_residency_kernel_rejects_capacity_beyond_its_key_packing() -> None:
    from torch_kvoffload.ops.triton.residency import MAX_CAPACITY, _check_capacity

    assert MAX_CAPACITY == 2**28
    _check_capacity("residency_update", torch.empty(1, 2**28, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"kvoffload::residency_update: .*capacity C = 268435457"):
        _check_capacity("residency_update", torch.empty(1, 2**28 + 1, dtype=torch.int32, device="meta"))

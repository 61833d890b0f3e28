"""Compile every Triton kernel of the ``kvoffload`` ops for CUDA targets, without a GPU.

    python benchmarks/triton_compile_check.py            (about 3 minutes on a 2-core machine)
    python benchmarks/triton_compile_check.py --full     (adds the C = 1024 / 4096 residency kernels)
    python benchmarks/triton_compile_check.py --targets 90 --sizes small

Each case is ``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", cc, 32))``:
Triton's whole pipeline (TTIR → TTGIR → LLVM IR → PTX) and ``ptxas`` (shipped with the triton wheel) down
to a cubin, which needs no driver. This catches what the interpreter does not enforce (``tl.dot`` minimum
tile sizes, an int8 dot's reduction dim ≥ 32, register-tile limits). Cases use the launchers' constexprs
at production shapes (DeepSeek-V3.2: 64 indexer heads, D 128, top-k 2048; MLA Dc 512, Dr 64) and at the
smallest values the launchers pick. Registers, spills and shared memory come from the cubin
(``cuobjdump -res-usage``) when the tool is there.

Prints a table and writes ``benchmarks/results/triton_compile_check.json``. Compiles into a fresh cache
directory, so the times are real compile times. Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Target compute capabilities checked by default (A100, H100/H200).
DEFAULT_TARGETS = (80, 90)


@dataclasses.dataclass(frozen=True)
class Case:
    """One compilation: ``kernel`` (``"<family>.<jit function>"``) with pointer element types, scalar
    float arguments and constexpr values; every other runtime argument is an ``i32``.

    A runtime argument named in ``constexprs`` is specialised to that value, as the JIT specialises an
    integer argument equal to 1 (a unit stride); ``aligned`` names the pointer and integer arguments the
    JIT marks divisible by 16 at launch (aligned allocations, strides such as 656), which decides
    whether loads are vectorised."""

    kernel: str
    label: str
    size: str  # "production" or "small"
    pointers: dict[str, str]
    constexprs: dict[str, Any]
    floats: tuple[str, ...] = ()
    num_warps: int = 4
    slow: bool = False
    aligned: tuple[str, ...] = ()


def _scores(label: str, size: str, dtype: str) -> Case:
    quant = dtype == "i8"
    weight = "*fp32" if quant or dtype == "fp32" else "*bf16"
    key = f"*{dtype}"
    block_h, block_d = (64, 128) if size == "production" else (16, 32 if quant else 16)
    # the float path passes weights / k_cache as the (unused) scale pointers
    ptrs = {
        "q_ptr": key, "w_ptr": weight, "qs_ptr": "*fp32" if quant else weight, "k_ptr": key,
        "ks_ptr": "*fp32" if quant else key, "table_ptr": "*i32", "req_ptr": "*i64", "vis_ptr": "*i64",
        "out_ptr": "*fp32",
    }  # fmt: skip
    consts = {
        "QUANT": quant, "IEEE": dtype == "fp32", "UPCAST": False, "BLOCK_S": 64, "BLOCK_H": block_h,
        "BLOCK_D": block_d,
    }  # fmt: skip
    return Case("indexer._scores_kernel", label, size, ptrs, consts)


def _residency(label: str, size: str, c: int, k: int, use_score: bool, slow: bool = False) -> Case:
    bc, bk = max(16, c), max(16, k)
    i32, i64 = "*i32", "*i64"
    ptrs = {
        "stt_ptr": i32, "order_ptr": i32, "row_req_ptr": i64, "topk_ptr": i32, "rid_ptr": i64,
        "stable_ptr": i64, "scores_ptr": "*fp32" if use_score else i32, "slots_ptr": i32, "mtok_ptr": i32,
        "mslot_ptr": i32, "mcount_ptr": i32, "evict_ptr": i32,
    }  # fmt: skip
    consts = {
        "USE_SCORE": use_score, "BC": bc, "LOG_BC": bc.bit_length() - 1, "BK": bk,
        "LOG_BK": bk.bit_length() - 1,
    }  # fmt: skip
    warps = 4 if bc <= 1024 else 8  # as launch_residency_rows
    return Case("residency._residency_rows_kernel", label, size, ptrs, consts, num_warps=warps, slow=slow)


def _attend(label: str, size: str, dtype: str, split: bool) -> Case:
    bdc, bdr = (512, 64) if size == "production" else (16, 16)
    t = f"*{dtype}"
    ptrs = {
        "qn_ptr": t, "qp_ptr": t, "kv_ptr": t, "pe_ptr": t, "idx_ptr": "*i32", "out_ptr": t,
        "lse_ptr": "*fp32", "part_ptr": "*fp32", "ml_ptr": "*fp32",
    }  # fmt: skip
    consts = {
        "BH": 16, "BN": 32 if bdc >= 256 else 64, "BDC": bdc, "BDR": bdr, "HAS_PE": True, "SPLIT": split,
        "PREC": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False,
    }  # fmt: skip
    warps = 8 if bdc >= 256 else 4  # as the attention launcher
    return Case("sparse_attention._attend_kernel", label, size, ptrs, consts, ("scale",), num_warps=warps)


def _fp8_attend(label: str, size: str, dtype: str, split: bool) -> Case:
    """The FP8-row attention kernel as a CUDA launch on contiguous tensors specialises it: unit strides
    (the rows' bytes, the queries' and output's last dims, the indices' columns, lse's heads), 16-byte
    aligned pointers and row strides (656-byte rows; H * Dc, Dc, H * Dr, Dr, K elements) and, at
    DeepSeek's shapes, sizes divisible by 16 (H 16 / 128, K 2048, Dc 512, Dr 64, whole row tiles)."""
    bdc, bdr = (512, 64) if size == "production" else (128, 16)
    t = f"*{dtype}"
    ptrs = {
        "qn_ptr": t, "qp_ptr": t, "kv_ptr": "*u8", "idx_ptr": "*i32", "out_ptr": t, "lse_ptr": "*fp32",
        "part_ptr": "*fp32", "ml_ptr": "*fp32",
    }  # fmt: skip
    consts = {
        "BH": 16, "BN": 32 if bdc >= 256 else 64, "BDC": bdc, "BDR": bdr, "HAS_PE": True, "SPLIT": split,
        "Q_KIND": 0 if dtype == "fp32" else 1, "UPCAST": False, "PIN": True,
        "kv_sb": 1, "qn_sd": 1, "qp_sd": 1, "idx_sk": 1, "out_sd": 1, "lse_sh": 1,
    }  # fmt: skip
    sizes = ("H", "K", "Dc", "Dr", "rows_per_split") if size == "production" else ()
    aligned = (*ptrs, "kv_sn", "qn_st", "qn_sh", "qp_st", "qp_sh", "idx_st", "out_st", "out_sh", *sizes)
    warps = 8 if bdc >= 256 else 4  # as the launcher (sparse_attention's tiling)
    return Case(
        "fp8_attention._fp8_attend_kernel", label, size, ptrs, consts, ("scale",), warps, aligned=aligned
    )


def _copy_units(label: str, size: str, bits: str, ndim: int, block: int) -> Case:
    return Case(
        "copy._copy_units_kernel",
        label,
        size,
        {"src_ptr": bits, "dst_ptr": bits, "src_idx_ptr": "*i64", "dst_idx_ptr": "*i64"},
        {"NDIM": ndim, "BLOCK": block},
    )


def compile_cases(*, full: bool = False) -> list[Case]:
    """Every case: production-like and small constexprs of each launched kernel (``full`` adds the
    C = 1024 and C = 4096 residency kernels: half a minute to minutes each)."""
    miss_ptrs = {
        "host_c_ptr": "*bf16", "host_p_ptr": "*bf16", "hot_c_ptr": "*bf16", "hot_p_ptr": "*bf16",
        "table_ptr": "*i32", "mtok_ptr": "*i32", "mslot_ptr": "*i32", "mcount_ptr": "*i32",
    }  # fmt: skip
    merge_ptrs = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
    topk_ptrs = {"scores_ptr": "*fp32", "vis_ptr": "*i64", "out_ptr": "*i32"}
    had_ptrs = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32"}

    def had8(t: str) -> dict[str, str]:
        return {"x_ptr": t, "out_ptr": "*u8"}

    def fp8_scores(w: str) -> dict[str, str]:
        return {
            "q_ptr": "*u8", "w_ptr": w, "k_ptr": "*u8", "table_ptr": "*i32", "req_ptr": "*i64", "vis_ptr": "*i64",
            "out_ptr": "*fp32",
        }  # fmt: skip

    def fp8_q(t: str) -> dict[str, str]:
        return {"x_ptr": t, "pe_ptr": t, "out_ptr": "*u8"}

    def fp8_d(t: str) -> dict[str, str]:
        return {"rows_ptr": "*u8", "x_ptr": t, "pe_ptr": t}

    cases = [
        _scores("bf16 H64 D128", "production", "bf16"),
        _scores("int8 H64 D128", "production", "i8"),
        _scores("fp32 H64 D128", "production", "fp32"),
        _scores("bf16 H16 D16", "small", "bf16"),
        _scores("int8 H16 D32", "small", "i8"),
        _scores("fp32 H16 D16", "small", "fp32"),
        Case("indexer._topk_kernel", "KP 2048", "production", topk_ptrs, {"KP": 2048, "LOG_KP": 11}),
        Case("indexer._topk_kernel", "KP 2", "small", topk_ptrs, {"KP": 2, "LOG_KP": 1}),
        Case("indexer._topk_kernel", "KP 64", "small", topk_ptrs, {"KP": 64, "LOG_KP": 6}),
        Case("indexer._hadamard_kernel", "D 128", "production", had_ptrs, {"D": 128, "LOG_D": 7}, ("norm",)),
        Case("indexer._hadamard_kernel", "D 16", "small", had_ptrs, {"D": 16, "LOG_D": 4}, ("norm",)),
        _copy_units("i64 1-dim BLOCK 2048", "production", "*i64", 1, 2048),
        _copy_units("i16 4-dim BLOCK 2048", "production", "*i16", 4, 2048),
        _copy_units("u8 1-dim BLOCK 16", "small", "*u8", 1, 16),
        Case("fp8._quantize_kernel", "bf16 Dc512 Dr64", "production", fp8_q("*bf16"),
             {"X_KIND": 1, "PE_KIND": 1, "INDEXER": False, "BLOCK_R": 16, "BLOCK_PE": 64}),
        Case("fp8._quantize_kernel", "fp32 indexer", "small", fp8_q("*fp32"),
             {"X_KIND": 0, "PE_KIND": 0, "INDEXER": True, "BLOCK_R": 16, "BLOCK_PE": 1}),
        Case("fp8._dequantize_kernel", "bf16 Dr64", "production", fp8_d("*bf16"),
             {"KIND": 1, "BLOCK_R": 16, "BLOCK_PE": 64}),
        Case("fp8._dequantize_kernel", "fp16 Dr1", "small", fp8_d("*fp16"), {"KIND": 2, "BLOCK_R": 16, "BLOCK_PE": 1}),
        Case("fp8_indexer._hadamard_fp8_kernel", "bf16 D 128", "production", had8("*bf16"),
             {"X_KIND": 1, "D": 128, "LOG_D": 7}, ("norm",)),
        Case("fp8_indexer._hadamard_fp8_kernel", "fp32 D 128", "small", had8("*fp32"),
             {"X_KIND": 0, "D": 128, "LOG_D": 7}, ("norm",)),
        Case("fp8_indexer._fp8_scores_kernel", "H64 D128", "production", fp8_scores("*fp32"),
             {"G": 1, "DOT_F32": False, "BLOCK_S": 64, "BLOCK_H": 64, "BLOCK_D": 32}, num_warps=8),
        Case("fp8_indexer._fp8_scores_kernel", "bf16 w H16 D256", "small", fp8_scores("*bf16"),
             {"G": 2, "DOT_F32": False, "BLOCK_S": 64, "BLOCK_H": 16, "BLOCK_D": 32}),
        _residency("lru C512 K256", "production", 512, 256, False),
        _residency("score C512 K256", "production", 512, 256, True),
        _residency("lru C16 K16", "small", 16, 16, False),
        _residency("score C16 K16", "small", 16, 16, True),
        _attend("bf16 Dc512 Dr64 split", "production", "bf16", True),
        _attend("bf16 Dc512 Dr64", "production", "bf16", False),
        _attend("fp32 Dc512 Dr64 split", "production", "fp32", True),
        _attend("fp32 Dc16 Dr16 split", "small", "fp32", True),
        _attend("bf16 Dc16 Dr16", "small", "bf16", False),
        # DeepSeek: H 16 and H 128 run the same 16-head blocks; K 2048 rows are split over the SMs
        _fp8_attend("bf16 H16/128 Dc512 Dr64 split", "production", "bf16", True),
        _fp8_attend("bf16 H16/128 Dc512 Dr64", "production", "bf16", False),
        _fp8_attend("fp32 H16/128 Dc512 Dr64 split", "production", "fp32", True),
        _fp8_attend("fp32 H16/128 Dc512 Dr64", "production", "fp32", False),
        _fp8_attend("bf16 Dc128 Dr16 split", "small", "bf16", True),
        _fp8_attend("fp32 Dc128 Dr16", "small", "fp32", False),
        Case("sparse_attention._merge_splits_kernel", "Dc 512", "production", merge_ptrs, {"BH": 16, "BDC": 512}),
        Case("sparse_attention._merge_splits_kernel", "Dc 16", "small", merge_ptrs, {"BH": 16, "BDC": 16}),
        Case("sparse_attention._copy_miss_rows_kernel", "bf16 BD 128", "production", miss_ptrs, {"BM": 16, "BD": 128}),
        Case("sparse_attention._copy_miss_rows_kernel", "bf16 BD 16", "small", miss_ptrs, {"BM": 16, "BD": 16}),
    ]  # fmt: skip
    if full:
        cases += [
            _residency("lru C1024 K512", "production", 1024, 512, False, True),
            _residency("score C1024 K512", "production", 1024, 512, True, True),
            _residency("lru C4096 K2048", "production", 4096, 2048, False, True),
            _residency("score C4096 K2048", "production", 4096, 2048, True, True),
        ]
    return cases


def jit_function(kernel: str):
    """The ``triton.JITFunction`` named ``"<family>.<name>"`` in ``torch_kvoffload.ops.triton``."""
    family, name = kernel.split(".")
    return getattr(importlib.import_module(f"torch_kvoffload.ops.triton.{family}"), name)


def launched_kernels() -> set[str]:
    """``"<family>.<name>"`` of every JIT function a family module launches (``name[grid](...)``);
    works under the interpreter too (where ``@triton.jit`` makes interpreted functions)."""
    import triton

    from torch_kvoffload.ops.triton import FAMILIES

    found = set()
    for family in FAMILIES:
        module = importlib.import_module(f"torch_kvoffload.ops.triton.{family}")
        source = inspect.getsource(module)
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.KernelInterface) and re.search(rf"\b{name}\[", source):
                # named by the module that defines it: a kernel another family imports is the same kernel
                fn = getattr(value, "fn", None)
                home = getattr(fn, "__module__", module.__name__).rsplit(".", 1)[-1]
                found.add(f"{home}.{getattr(fn, '__name__', name)}")
    return found


def signature(case: Case) -> dict[str, str]:
    """Triton signature of ``case``'s kernel: each parameter's type, ``"constexpr"`` for constexprs."""
    fn = jit_function(case.kernel)
    sig = {}
    for p in fn.params:
        if p.is_constexpr or p.name in case.constexprs:  # a constexpr, or a runtime argument specialised
            sig[p.name] = "constexpr"
        elif p.name in case.pointers:
            sig[p.name] = case.pointers[p.name]
        elif p.name in case.floats:
            sig[p.name] = "fp32"
        elif p.name.endswith("_ptr"):
            raise ValueError(f"compile case {case.kernel} {case.label!r}: no element type for {p.name}")
        else:
            sig[p.name] = "i32"
    unknown = (set(case.pointers) | set(case.floats) | set(case.constexprs) | set(case.aligned)) - set(sig)
    if unknown:
        raise ValueError(f"compile case {case.kernel} {case.label!r}: {sorted(unknown)} are not parameters")
    return sig


def ptxas_available() -> bool:
    """Whether triton's CUDA backend and its ``ptxas`` are usable here (no GPU needed)."""
    try:
        import triton.backends

        if "nvidia" not in triton.backends.backends:
            return False
        from triton.backends.nvidia.compiler import get_ptxas

        return all(Path(get_ptxas(cc).path).exists() for cc in DEFAULT_TARGETS)
    except Exception:
        return False


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``{"registers", "stack", "shared", "local"}`` of a cubin from ``cuobjdump -res-usage``, or ``{}``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        found = shutil.which("cuobjdump")
        if found is None:
            return {}
        tool = Path(found)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = {"REG": "registers", "STACK": "stack", "SHARED": "shared", "LOCAL": "local"}
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {fields[k]: int(v) for k, v in found.items()}


def compile_case(case: Case, capability: int):
    """``triton.compile`` ``case`` for ``GPUTarget("cuda", capability, 32)``.

    Returns ``(compiled kernel, ptxas log)``; the log (``ptxas -v``: registers, spill stores) is empty
    when the cubin came from Triton's cache.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(case.kernel)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in case.aligned}
    src = ASTSource(fn=fn, signature=signature(case), constexprs=dict(case.constexprs), attrs=attrs)
    log = io.StringIO()
    dump = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v runs anyway; this prints its log
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                src, target=GPUTarget("cuda", capability, 32), options={"num_warps": case.num_warps}
            )
    finally:
        triton.knobs.nvidia.dump_ptxas_log = dump
    return kernel, log.getvalue()


def spill_bytes(ptxas_log: str) -> int | None:
    """Bytes of register spill stores in a ``ptxas -v`` log (summed over functions), or ``None``."""
    found = re.findall(r"(\d+) bytes spill stores", ptxas_log)
    return sum(int(n) for n in found) if found else None


def run(cases: list[Case], targets: tuple[int, ...]) -> list[dict[str, Any]]:
    """Compile every case for every target; one result row each (``ok``, ``seconds``, resources)."""
    rows = []
    for case in cases:
        for cc in targets:
            row: dict[str, Any] = {
                "kernel": case.kernel, "case": case.label, "size": case.size, "target": f"sm_{cc}",
                "num_warps": case.num_warps,
            }  # fmt: skip
            start = time.perf_counter()
            try:
                kernel, log = compile_case(case, cc)
            except Exception as exc:
                row.update(ok=False, seconds=round(time.perf_counter() - start, 2), error=str(exc)[-2000:])
            else:
                row.update(ok=True, seconds=round(time.perf_counter() - start, 2))
                row.update(resource_usage(kernel.asm["cubin"]))
                row["spill_store_bytes"] = spill_bytes(log)
            rows.append(row)
            status = "ok" if row["ok"] else "FAILED"
            print(f"  {case.kernel} [{case.label}] sm_{cc}: {status} {row['seconds']} s", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="add the slow C = 1024 / 4096 residency kernels")
    parser.add_argument("--targets", default=",".join(map(str, DEFAULT_TARGETS)), help="e.g. 80,90")
    parser.add_argument("--sizes", choices=("all", "production", "small"), default="all")
    args = parser.parse_args()
    targets = tuple(int(t) for t in args.targets.split(","))

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import format_table, machine_info, write_json

    if not ptxas_available():
        print("triton's CUDA backend (ptxas) is not available: nothing to check")
        return 0
    cases = [c for c in compile_cases(full=args.full) if args.sizes in ("all", c.size)]
    missing = launched_kernels() - {c.kernel for c in cases}
    if missing:
        print(f"kernels without a compile case: {sorted(missing)}")
        return 1
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # fresh cache: real compile times
        rows = run(cases, targets)
    import triton

    headers = ["kernel", "case", "target", "warps", "ok", "seconds", "registers", "spill B", "shared B"]
    table = [
        [
            r["kernel"], r["case"], r["target"], r["num_warps"], "ok" if r["ok"] else "FAILED", r["seconds"],
            r.get("registers", "-"), r.get("spill_store_bytes", "-"), r.get("shared", "-"),
        ]
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows)} compilations, {sum(not r['ok'] for r in rows)} failed, {total:.0f} s")
    path = write_json(
        "triton_compile_check",
        {"machine": machine_info(), "triton": triton.__version__, "full": args.full, "results": rows},
    )
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

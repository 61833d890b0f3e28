"""Offload of a tensor-parallel Hugging Face model: tiny DeepseekV3 / V32 saved to a directory and loaded
with ``tp_plan="auto"`` on every rank of 2 and of 4 processes (spawn, gloo on 127.0.0.1).

Modes: sparse decode offload over the TP group's shared host pool (TP rank 0 allocates and writes it, the
other ranks attach it and read; in the model's dtype, and of FP8 latent rows with the FP8 indexer against the
unmodified model with its latent KV through FlashMLA's quantization and its indexer scoring FP8), resident sparse, layerwise, layerwise + sparse. Every rank's tokens are
compared with the unmodified single-process model's ``generate`` (greedy, left-padded batch; beam search
too), a chunked prefill's logits with its one-shot forward. The shared pool is checked for real: one
``/dev/shm`` file of the size the layout gives, the same name on every rank, rows written by TP rank 0
only, a new pool for a sequence of other sizes and the old one removed, a failed attach raising on every
rank. Hybrid sparse (``offload="auto"``) at a budget that spills requests mid-generation: every rank takes the
decisions the single-process model takes at that budget (same counts), a spill failing on one rank fails
the call on every rank, and the next call works. Prefix reuse: a prompt run again is taken over from every rank's store alike, in ``generate`` and
under continuous batching; when one rank's store loses it after the lookup no rank takes it over. All cases
of a world size run in one spawn (process start-up dominates).
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

pytest.importorskip("transformers")

from support.fp8_reference import fp8_indexer, fp8_latent_kv
from support.hf_models import build_model, left_padded_batch
from support.kvpp_helpers import spawn_gloo
from support.store_helpers import store_emptied_after_each_lookup
from support.tp_helpers import load_tp, save_tiny

import torch_kvoffload
from torch_kvoffload.sparse.backend import FENCE_TIMEOUT_S

BS = 4  # tokens per block: the prompts span several blocks (beams share their full ones)
OVERRIDES = {"num_hidden_layers": 2}  # 4 attention heads (divisible by 2 and 4), 32 indexer heads
# the FP8 rows quantise 128-wide tiles: that family's model has kv_lora_rank and index_head_dim 128
FP8_WIDTHS = {**OVERRIDES, "kv_lora_rank": 128, "index_head_dim": 128}
SHM = "/dev/shm"
# a reader waits at most FENCE_TIMEOUT_S for the writer, a collective at most spawn_gloo's process-group
# timeout (60 s); a spawn that outlives both by the run itself is stuck
TIMEOUT_S = FENCE_TIMEOUT_S + 60 + 120

# generate() runs: (lengths, prompt seed, max_new_tokens, extra generate arguments)
RUNS = {
    "a": ([20, 13], 0, 16, {}),
    "a_again": ([20, 13], 0, 16, {}),  # the same prompts: the store holds their blocks
    "b": ([9, 17, 5], 1, 24, {}),  # other sizes: the caches (and the shared pool) are built anew
    "beam": ([20, 13], 0, 12, {"num_beams": 2}),  # forks: the beams share host-pool blocks
    "a_lost": ([20, 13], 0, 16, {}),  # "a" again; TP rank 1's store loses the prefix after its lookup
}
CHUNK = (21, 5, 10)  # a prompt of 21 tokens (seed 5) fed as 10 + 11 tokens: the second reads the pool
# continuous batching (generate_batch): prompt lengths, new tokens, 3 requests held of 64 tokens at most;
# its model's token-0 embedding is not zero (a zero indexer query ties every score: an arbitrary top-k)
CB_LENGTHS, CB_NEW, CB_SLOTS, CB_TOKENS = (3, 40, 7, 25, 12, 33), 8, 3, 64

SPARSE = {"sparse": {}, "block_size": BS}
# a shared host pool of FP8 latent rows, each rank's indexer cache of FP8 rows
SPARSE_FP8 = {"sparse": {"kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"}, "block_size": BS}
RESIDENT = {"sparse": {"offload": False}, "block_size": BS}
# hybrid sparse; the fixture sets serving.device_kv_budget (see _auto_budget)
AUTO = {"sparse": {"offload": "auto", "capacity": 8}, "block_size": BS}  # hot rows: a top-k of 8
AUTO_MOVES = ("spills", "promotions", "started_offloaded", "spill_bytes_d2h", "promote_bytes_h2d")
# hybrid sparse under continuous batching; the fixture sets serving.device_kv_budget (see _auto_cb_budget)
AUTO_CB = {**AUTO, "serving": {"max_requests": CB_SLOTS, "max_request_tokens": CB_TOKENS}}
LAYERWISE = {"layerwise": {}, "block_size": BS}
BOTH = {"layerwise": {}, "sparse": {}, "block_size": BS}
SERVING = {
    "layerwise": {},
    "sparse": {},
    "block_size": BS,
    "serving": {"max_requests": CB_SLOTS, "max_request_tokens": CB_TOKENS},
}

# (name, family, config, runs); "chunk": the chunked prefill, "fail": an attach that fails on the readers
TWO = [
    ("v32-sparse", "deepseek_v32", SPARSE, ["a", "b", "beam", "chunk", "fail", "a_again"]),
    ("v32-resident", "deepseek_v32", RESIDENT, ["a", "b"]),
    ("v32-layerwise", "deepseek_v32", LAYERWISE, ["a", "a_again"]),
    ("v32-both", "deepseek_v32", BOTH, ["a", "b", "a_again", "a_lost"]),
    ("v3-layerwise", "deepseek_v3", LAYERWISE, ["a", "a_again", "b"]),
    ("v32-both-cb", "deepseek_v32-cb", SERVING, ["cb_diverged", "cb_failed", "cb", "cb_again"]),
    ("v32-sparse-fp8", "deepseek_v32-fp8", SPARSE_FP8, ["a", "b"]),
    ("v32-auto", "deepseek_v32", AUTO, ["a", "beam", "auto_fail", "a_again"]),
    ("v32-auto-cb", "deepseek_v32-cb", AUTO_CB, ["cb", "cb_spill_failed", "cb_again"]),
]
# four ranks: one attention head each, the host pool shared by four; the modes' own paths run on two
FOUR = [
    ("v32-sparse", "deepseek_v32", SPARSE, ["a", "b"]),
    ("v3-layerwise", "deepseek_v3", LAYERWISE, ["a", "a_again"]),
]


def _generate_kwargs(run: str) -> dict:
    lengths, seed, new, extra = RUNS[run]
    ids, mask = left_padded_batch(lengths, seed=seed)
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **extra)


def _chunk_prompt() -> torch.Tensor:
    n, seed, _ = CHUNK
    return left_padded_batch([n], seed=seed)[0]


def _cb_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in CB_LENGTHS]


def _cb_generation():
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=CB_NEW, do_sample=False, eos_token_id=999_999, pad_token_id=0)


# ------------------------------------------------------------------------------------------- ranks
def _pool_files() -> set[str]:
    """The shared host pools this process created that still exist."""
    return {f for f in os.listdir(SHM) if f.startswith(f"kvoffload-pool-{os.getpid()}-")}


def _pool_info(session) -> dict | None:
    rt = session.sparse_offload
    if rt is None:
        return None
    pool = rt.pool
    # the owner's file: a reader's look could race with TP rank 0 replacing the pool for its next sequence
    size = os.stat(os.path.join(SHM, pool.name)).st_size if pool.owner and pool.name is not None else None
    return {"name": pool.name, "writer": rt.writer, "owner": pool.owner, "file_bytes": size}


def _record(model, session) -> dict:
    return {
        "stats": torch_kvoffload.stats(model),
        "backend": session.core.backends.sparse.stats() if session.core.backends.sparse is not None else {},
        "pool": _pool_info(session),
        "pool_files": _pool_files(),
    }


def _run(run: str, model, session) -> dict:
    if run == "chunk":
        prompt, split = _chunk_prompt(), CHUNK[2]
        session.end_sequence()  # generate() leaves its sequence open
        session.reserve(1, 32)
        cache = session.new_cache()
        model(input_ids=prompt[:, :split], cache=cache)
        logits = model(input_ids=prompt[:, split:], cache=cache).logits
        return {"logits": logits, **_record(model, session)}
    if run == "fail":
        return _failed_attach(model, session)
    if run == "auto_fail":
        return _failed_spill(model, session)
    if run == "a_lost":
        with store_emptied_after_each_lookup(active=session.spec.tp.rank == 1):  # TP rank 1's store only
            return {"tokens": model.generate(**_generate_kwargs(run)), **_record(model, session)}
    if run in ("cb", "cb_diverged", "cb_failed", "cb_again", "cb_spill_failed"):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(page_size=8, max_batch_tokens=16, max_requests_per_batch=4)
        with _fault_on_rank_1(run, session.spec.tp.rank):
            out = model.generate_batch(
                _cb_prompts(), generation_config=_cb_generation(), continuous_batching_config=cb
            )
        order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
        tokens = [list(out[rid].generated_tokens) for rid in order]
        return {"tokens": tokens, "errors": [out[rid].error for rid in order], **_record(model, session)}
    return {"tokens": model.generate(**_generate_kwargs(run)), **_record(model, session)}


@contextlib.contextmanager
def _fault_on_rank_1(run: str, rank: int):
    """On TP rank 1 only, the first continuous-batching step is fed other tokens ("cb_diverged": as a
    sampler out of step with TP rank 0's would) or fails before its forward ("cb_failed")."""
    from torch_kvoffload.integrations.hf.serving import ServingRequests

    real_run, real_check = ServingRequests.run_step, ServingRequests._step_requests
    first = [True]

    def diverged(self, model, kwargs):
        if first[0]:
            first[0] = False
            kwargs = {**kwargs, "input_ids": kwargs["input_ids"] + 1}
        return real_run(self, model, kwargs)

    def failed(self, *args):
        if first[0]:
            first[0] = False
            raise RuntimeError("injected: rank 1 cannot run the step")
        return real_check(self, *args)

    from torch_kvoffload.sparse.hybrid_backend import HybridSparseBackend

    real_spill = HybridSparseBackend._to_host

    def spill_failed(self, rid, upto):
        if first[0]:
            first[0] = False
            raise RuntimeError("injected: rank 1 cannot spill")
        return real_spill(self, rid, upto)

    if rank == 1 and run == "cb_diverged":
        ServingRequests.run_step = diverged
    elif rank == 1 and run == "cb_failed":
        ServingRequests._step_requests = failed
    elif rank == 1 and run == "cb_spill_failed":  # hybrid sparse: the first spill fails on rank 1
        HybridSparseBackend._to_host = spill_failed
    try:
        yield
    finally:
        ServingRequests.run_step, ServingRequests._step_requests = real_run, real_check
        HybridSparseBackend._to_host = real_spill


def _failed_attach(model, session) -> dict:
    """The readers cannot attach the pool TP rank 0 created for a new sequence: every rank raises (no rank
    waits for the others), TP rank 0 removes its file, and the next sequence works again."""
    from torch_kvoffload.sparse import backend as sparse_offload

    real = sparse_offload.HostKVPool.attach

    def refuse(name, **dims):
        raise OSError(f"injected: cannot map {name}")

    if session.spec.tp.rank != 0:
        sparse_offload.HostKVPool.attach = refuse
    try:
        with pytest.raises(Exception) as info:
            model.generate(**_generate_kwargs("b"))
    finally:
        sparse_offload.HostKVPool.attach = real
    return {"error": f"{type(info.value).__name__}: {info.value}", **_record(model, session)}


def _failed_spill(model, session) -> dict:
    """TP rank 1 cannot spill: every rank's call raises (rank 0 naming rank 1's error)."""
    from torch_kvoffload.sparse.hybrid_backend import HybridSparseBackend

    real = HybridSparseBackend._to_host

    def refuse(self, rid, upto):
        raise RuntimeError("injected: rank 1 cannot spill")

    if session.spec.tp.rank == 1:
        HybridSparseBackend._to_host = refuse
    try:
        with pytest.raises(Exception) as info:
            model.generate(**_generate_kwargs("beam"))
    finally:
        HybridSparseBackend._to_host = real
    return {"error": f"{type(info.value).__name__}: {info.value}", **_record(model, session)}


def _auto_budget(ref) -> tuple[int, dict]:
    """A budget holding the beam run's offloaded footprint and a fifth of the pool its beams fully resident
    take (its beams are spilled and promoted, run "a"'s requests stay resident), and the single-process
    model's move counts after each run at that budget."""
    roomy = torch_kvoffload.offload(copy.deepcopy(ref), {**AUTO, "serving": {"device_kv_budget": 1 << 40}})
    roomy.generate(**_generate_kwargs("beam"))
    st = torch_kvoffload.stats(roomy)
    budget = int(st["offloaded_kv_bytes"] + st["resident_kv_bytes_wanted"] // 5)
    probe = torch_kvoffload.offload(copy.deepcopy(ref), {**AUTO, "serving": {"device_kv_budget": budget}})
    moves = {}
    for run in ("a", "beam"):
        probe.generate(**_generate_kwargs(run))
        moves[run] = {k: torch_kvoffload.stats(probe)[k] for k in AUTO_MOVES}
    return budget, moves


def _auto_cb_budget(ref) -> int:
    """Three requests' offloaded footprints under continuous batching: what the hot buffers and indexer rows
    the requests do not use yet leave holds some of them resident, the others are spilled."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from torch_kvoffload.integrations.hf import session_of

    probe = torch_kvoffload.offload(copy.deepcopy(ref), AUTO_CB)
    cb = ContinuousBatchingConfig(page_size=8, max_batch_tokens=16, max_requests_per_batch=4)
    probe.init_continuous_batching(generation_config=_cb_generation(), continuous_batching_config=cb).stop()
    s = session_of(probe).serving
    return s.fixed_device_bytes + CB_SLOTS * s.device_bytes_per_request


def _worker(rank: int, world: int, dirs: dict[str, str], cases: list, out_dir: str) -> None:
    from torch_kvoffload.integrations.hf import session_of

    results = {}
    for name, family, cfg, runs in cases:
        with torch.no_grad():
            model = torch_kvoffload.offload(load_tp(dirs[family], rank, world), cfg)
            session = session_of(model)
            tp = session.spec.tp
            res = {"tp": (tp.size, tp.rank), "fingerprint": session.spec.weights_fingerprint, "runs": {}}
            for run in runs:
                res["runs"][run] = _run(run, model, session)
            session.close()
        res["files_after_close"] = _pool_files()
        results[name] = res
    torch.save(results, f"{out_dir}/rank{rank}.pt")


# ------------------------------------------------------------------------------------------ parent
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny models saved once, and the unmodified single-process model's outputs of every run."""
    root = tmp_path_factory.mktemp("tp_models")
    dirs, want = {}, {}
    with torch.no_grad():
        for family in ("deepseek_v3", "deepseek_v32"):
            dirs[family] = save_tiny(family, root / family, **OVERRIDES)
            ref = build_model(family, **OVERRIDES)
            want[family] = {run: ref.generate(**_generate_kwargs(run)) for run in RUNS}
            want[family]["chunk"] = ref(input_ids=_chunk_prompt()).logits[:, CHUNK[2] :]
            if family == "deepseek_v32":
                want["auto_budget"], want["auto_moves"] = _auto_budget(ref)
        # FP8 rows: the unmodified model with its latent KV through FlashMLA's quantization and its indexer
        # scoring FP8 queries and keys
        dirs["deepseek_v32-fp8"] = save_tiny("deepseek_v32", root / "fp8", **FP8_WIDTHS)
        ref = build_model("deepseek_v32", **FP8_WIDTHS)
        with fp8_latent_kv(ref), fp8_indexer():
            want["deepseek_v32-fp8"] = {run: ref.generate(**_generate_kwargs(run)) for run in ("a", "b")}
        ref = build_model("deepseek_v32", **OVERRIDES)
        ref.model.embed_tokens.weight[0].normal_()
        ref.save_pretrained(str(root / "cb"))
        dirs["deepseek_v32-cb"] = str(root / "cb")
        gen = _cb_generation()
        want["deepseek_v32-cb"] = {
            "cb": [
                ref.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist()
                for p in _cb_prompts()
            ]
        }
        want["auto_cb_budget"] = _auto_cb_budget(ref)
    return dirs, want


def _spawn(tmp_path_factory, dirs: dict, world: int, cases: list) -> list[dict]:
    out = tmp_path_factory.mktemp(f"tp{world}")
    spawn_gloo(_worker, world, dirs, cases, str(out), timeout=TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(saved, tmp_path_factory):
    budgets = {id(AUTO): saved[1]["auto_budget"], id(AUTO_CB): saved[1]["auto_cb_budget"]}

    def budgeted(c: dict) -> dict:
        if id(c) not in budgets:
            return c
        return {**c, "serving": {**c.get("serving", {}), "device_kv_budget": budgets[id(c)]}}

    cases = [(n, f, budgeted(c), r) for n, f, c, r in TWO]
    return _spawn(tmp_path_factory, saved[0], 2, cases)


@pytest.fixture(scope="module")
def four_ranks(saved, tmp_path_factory):
    return _spawn(tmp_path_factory, saved[0], 4, FOUR)


def _layout(run: str) -> tuple[int, int]:
    """``(requests, tokens per request)`` a run's caches are sized for: the batch (x beams) and the prompt
    width + ``max_new_tokens`` - 1 (the last token's KV is never computed); the chunked prefill: what it
    reserves."""
    if run == "chunk":
        return 1, 32
    if run in ("cb", "cb_again"):
        return CB_SLOTS, CB_TOKENS
    lengths, _, new, extra = RUNS[run]
    return len(lengths) * extra.get("num_beams", 1), max(lengths) + new - 1


def _rows_written(run: str) -> int | None:
    """Rows per layer a run appends to the host pool: every real token but the last generated one (its
    KV is never computed); ``None`` for beam search (the beams' rows depend on the search) and for
    "a_lost" (TP rank 0 also wrote the rows of the prefix it took over before it learnt rank 1 could not)."""
    if run == "chunk":
        return CHUNK[0]
    if run in ("cb", "cb_again"):  # the prompts again: the rows taken over are written as computed ones
        return sum(n + CB_NEW - 1 for n in CB_LENGTHS)
    lengths, _, new, extra = RUNS[run]
    return None if extra or run == "a_lost" else sum(n + new - 1 for n in lengths)


def _pool_bytes(requests: int, tokens: int, layers: int, kv_bytes: int, pe_bytes: int) -> int:
    """A shared pool's file, written out: a 4 KiB header (description + per-layer fence), then every
    layer's ``kv_c`` rows (4 KiB aligned) and ``k_pe`` rows of ``requests`` x ``ceil(tokens / BS)`` blocks
    (``kv_bytes`` / ``pe_bytes`` a row)."""
    rows = layers * requests * -(-tokens // BS) * BS
    return 4096 + -(-rows * kv_bytes // 4096) * 4096 + rows * pe_bytes


def _check_case(results: list[dict], want: dict, case: tuple) -> None:
    from support.hf_models import tiny_config

    name, family, config, runs = case
    world = len(results)
    fp8 = family.endswith("-fp8")
    cfg = tiny_config(family.split("-")[0], **(FP8_WIDTHS if fp8 else OVERRIDES))
    layers, Dc, Dr = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # a pool row's bytes (fp32 model): the latent and RoPE values, or one FP8 row (Dc e4m3 values, one fp32
    # scale per 128, Dr bf16 values) and no separate RoPE part
    row = (Dc + 4 * (Dc // 128) + 2 * Dr, 0) if fp8 else (Dc * 4, Dr * 4)
    shared = "sparse" in config and config["sparse"].get("offload", True)
    assert [r[name]["tp"] for r in results] == [(world, rank) for rank in range(world)]
    if "layerwise" in config:  # each rank hashes its own weight shards: its store keys are its own
        assert len({r[name]["fingerprint"] for r in results} - {""}) == world
    prev_name, prev_d2h, prev_run = None, 0, None
    for run in runs:
        got = [r[name]["runs"][run] for r in results]
        if run == "fail":
            rank0, *readers = (g["error"] for g in got)
            assert rank0.startswith("RuntimeError") and "TP rank 1: OSError: injected" in rank0, rank0
            assert all(e.startswith("OSError: injected") for e in readers), readers
            # no rank holds a pool, TP rank 0 removed the file it created for the failed sequence
            assert got[0]["pool_files"] == set() and all(g["pool"] is None for g in got)
            prev_name, prev_d2h, prev_run = None, got[0]["backend"]["bytes_d2h"], None
            continue
        if run == "auto_fail":
            rank0, rank1 = (g["error"] for g in got)
            assert rank1 == "RuntimeError: injected: rank 1 cannot spill", rank1
            assert rank0.startswith("RuntimeError: hybrid sparse: a spill failed on TP rank 1"), rank0
            prev_name, prev_d2h, prev_run = None, got[0]["backend"]["bytes_d2h"], None
            continue
        # a step's requests fail on every rank, by name
        if run in ("cb_diverged", "cb_failed", "cb_spill_failed"):
            failed = [[i for i, e in enumerate(g["errors"]) if e is not None] for g in got]
            assert failed[0] and all(f == failed[0] for f in failed), failed
            errors = [str(g["errors"][i]) for g in got for i in failed[0]]
            # the step whose spill failed on rank 1 (hybrid sparse), not the first; else the first step's
            if run == "cb_spill_failed":
                assert any("injected: rank 1 cannot spill" in e for e in errors), errors
                assert all(
                    "spill failed" in e or "cannot continue" in e or "injected" in e for e in errors
                ), errors
                assert len(failed[0]) < len(CB_LENGTHS), "some requests ran after the failure"
            else:
                message = {
                    "cb_diverged": "the TP ranks run different steps",
                    "cb_failed": "injected: rank 1 cannot run the step",
                }[run]
                assert all(message in e for e in errors), got[0]["errors"]
            if run == "cb_failed":
                assert all("the step failed on TP rank 1" in str(got[0]["errors"][i]) for i in failed[0])
            # the other requests ran to the end (after a failed spill, on caches rebuilt on both ranks), their
            # tokens those of the unmodified model
            for g in got:
                for i, tokens in enumerate(g["tokens"]):
                    if i not in failed[0]:
                        assert tokens == want[family]["cb"][i], (run, i)
            assert all(g["stats"]["reserved_requests"] == 0 for g in got)
            prev_name, prev_d2h, prev_run = None, got[0]["backend"]["bytes_d2h"], None
            continue
        for rank, g in enumerate(got):
            if run == "chunk":
                torch.testing.assert_close(g["logits"], want[family]["chunk"], rtol=1e-4, atol=1e-5)
            elif run in ("cb", "cb_again"):
                assert g["tokens"] == want[family]["cb"], f"{name} {run} rank {rank}"
            else:
                diff = (
                    (g["tokens"] != want[family][run]).sum()
                    if g["tokens"].shape == want[family][run].shape
                    else "all"
                )
                assert torch.equal(g["tokens"], want[family][run]), (
                    f"{name} {run} rank {rank}: {diff} tokens differ"
                )
        if run == "a_again":  # every rank found the prompts' blocks in its store
            if "layerwise" in config:  # (without layerwise offload: its prefix store, filled after forwards)
                assert all(g["stats"]["store_hits"] > r[name]["runs"]["a"]["stats"]["store_hits"]
                           for g, r in zip(got, results, strict=True))  # fmt: skip
            # ... and every rank took the same prefix over instead of computing it (prefix reuse): of the
            # left-padded rows of 20 and 13 tokens (blocks of 4), the 16 columns before row 0's last block
            # hold 16 and 9 of their tokens
            earlier = runs[: runs.index(run)]  # the last run with figures ("fail" has none)
            previous = next(p for p in reversed(earlier) if "stats" in results[0][name]["runs"][p])
            adopted = [
                g["stats"]["prefix_store_tokens"] - r[name]["runs"][previous]["stats"]["prefix_store_tokens"]
                for g, r in zip(got, results, strict=True)
            ]
            assert adopted == [16 + 9] * world, adopted
        if run == "cb_again":  # every request took its prompt's full blocks over, on every rank alike
            previous = runs[runs.index(run) - 1]
            before = [r[name]["runs"][previous]["stats"]["prefix_store_tokens"] for r in results]
            adopted = [g["stats"]["prefix_store_tokens"] - b for g, b in zip(got, before, strict=True)]
            assert adopted == [sum((n - 1) // BS * BS for n in CB_LENGTHS)] * world, adopted
        if run == "a_lost":  # every rank counts the prefix it did not take over and computed the prompt
            before = [r[name]["runs"][runs[runs.index(run) - 1]]["stats"] for r in results]
            pairs = list(zip(got, before, strict=True))
            assert [g["stats"]["prefix_fallbacks"] - b["prefix_fallbacks"] for g, b in pairs] == [1] * world
            assert [g["stats"]["prefix_store_tokens"] - b["prefix_store_tokens"] for g, b in pairs] == [
                0
            ] * world
        backend = [g["backend"] for g in got]
        if not shared:
            assert all(
                g["pool"] is None and b.get("host_pool_bytes", 0) == 0
                for g, b in zip(got, backend, strict=True)
            )
            continue
        pools = [g["pool"] for g in got]
        # one pool: TP rank 0's file, attached by name on every other rank, written by rank 0 only
        assert len({p["name"] for p in pools}) == 1
        assert [(p["writer"], p["owner"]) for p in pools] == [(True, True)] + [(False, False)] * (world - 1)
        size = _pool_bytes(*_layout(run), layers, *row)
        assert pools[0]["file_bytes"] == size, run
        # a sequence of other sizes got a new pool (one of the same sizes keeps it); the previous file is gone
        assert (pools[0]["name"] == prev_name) == (prev_run is not None and _layout(prev_run) == _layout(run))
        assert got[0]["pool_files"] == {pools[0]["name"]}
        # the host pool exists once: TP rank 0 counts its bytes, the readers count them as shared
        assert [b["host_pool_bytes"] for b in backend] == [size] + [0] * (world - 1)
        assert [b["shared_host_pool_bytes"] for b in backend] == [0] + [size] * (world - 1)
        # ... and so does the public stats()
        public = [(g["stats"]["host_pool_bytes"], g["stats"]["shared_host_pool_bytes"]) for g in got]
        assert public == [(size, 0)] + [(0, size)] * (world - 1)
        # the rows reach the pool once: TP rank 0 copied every new row of every layer, the readers none
        d2h = backend[0]["bytes_d2h"] - prev_d2h
        # hybrid sparse: rows reach the pool as requests are offloaded, the same moves on every rank
        if config in (AUTO, AUTO_CB):
            moves = [{k: b[k] for k in AUTO_MOVES} for b in backend]
            # this run's moves (a spill that failed on one rank only counted on the others before)
            earlier = runs[: runs.index(run)]
            last = [r[name]["runs"][earlier[-1]]["backend"] for r in results] if earlier else None
            own = [
                {k: m[k] - (b[k] if last else 0) for k in AUTO_MOVES}
                for m, b in zip(moves, last or moves, strict=True)
            ]
            assert all(m == own[0] for m in own), (run, own)
            if config is AUTO and run in want["auto_moves"]:  # ... and the single process's
                assert moves == [want["auto_moves"][run]] * world, (run, moves)
            assert moves[0]["spills"] > 0 or run == "a", "the budget spills requests mid-generation"
        else:
            written = _rows_written(run)
            assert d2h == layers * written * sum(row) if written is not None else d2h > 0
        assert all(b["bytes_d2h"] == 0 for b in backend[1:])
        # every rank loads its own hot rows from the shared pool
        assert all(b["bytes_h2d"] == backend[0]["bytes_h2d"] for b in backend)
        assert backend[0]["bytes_h2d"] > 0 or (config is AUTO and run == "a"), "hybrid: run a stays resident"
        if (
            run == "beam" and config is not AUTO
        ):  # the beams share their prompts' full blocks on every rank alike
            assert all(b["fork_shared_blocks"] == backend[0]["fork_shared_blocks"] > 0 for b in backend)
        prev_name, prev_d2h, prev_run = pools[0]["name"], backend[0]["bytes_d2h"], run
    for rank, r in enumerate(results):
        assert r[name]["files_after_close"] == set(), f"rank {rank} left {r[name]['files_after_close']}"


@pytest.mark.parametrize("case", TWO, ids=[c[0] for c in TWO])
def test_two_ranks(saved, two_ranks, case):
    _check_case(two_ranks, saved[1], case)


@pytest.mark.parametrize("case", FOUR, ids=[c[0] for c in FOUR])
def test_four_ranks(saved, four_ranks, case):
    _check_case(four_ranks, saved[1], case)

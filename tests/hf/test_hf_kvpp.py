"""KVPP on the Hugging Face path: 2 and 4 processes (spawn, gloo on 127.0.0.1), tiny DeepseekV3 / V32
loaded with transformers' tensor parallelism (``tp_plan="auto"``): the KVPP group is the model's TP group.

Every rank runs its shard of the model and generates greedily from the same left-padded batch; its KV
lives in the KVPP pool (owned layers persistent, the others in two scratch buffers filled by the owner's
broadcast). The reference is the unmodified single-process model, generated on each rank. Byte counts
are checked against formulas written out here. The four-rank case keeps the latent KV and the indexer keys as
DeepSeek's FP8 rows (``kvpp.kv_dtype`` / ``indexer_dtype`` ``"fp8_e4m3"``): its reference passes the unmodified
model's latent KV through the FP8 row and scores its indexer from FP8 queries and keys
(``support.fp8_reference``), its bundles and broadcasts hold the rows' bytes.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

pytest.importorskip("transformers")

from support.fp8_reference import fp8_indexer, fp8_latent_kv
from support.hf_models import SMALL, build_model, left_padded_batch
from support.kvpp_helpers import spawn_gloo
from support.store_helpers import store_emptied_after_each_lookup
from support.tp_helpers import load_tp, save_tiny

import torch_kvoffload
from torch_kvoffload import OffloadConfig
from torch_kvoffload.ops.fp8 import kv_row_bytes
from torch_kvoffload.ops.fp8_attention import dequantize_rows

NEW = 16  # decode steps cross two block boundaries of the longer prompt (20 + 16 tokens, blocks of 8)
BS = 8
SCRATCH_ALIGN = 2 << 20  # the KVPP scratch buffers are rounded up to 2 MiB
TIMEOUT_S = 150.0


def _worker(rank: int, world: int, cases: list[tuple], dirs: dict[str, str], out_dir: str) -> None:
    from torch_kvoffload.integrations.hf import session_of

    results = {}
    for name, family, overrides, lengths, compiled in cases:
        torch._dynamo.reset()
        ids, mask = left_padded_batch(lengths, seed=0)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        fp8 = name in FP8_CASES
        with torch.no_grad():
            ref = build_model(family, **overrides)
            # the reference's KV as kept
            as_kept = functools.partial(_fp8_formats, ref) if fp8 else contextlib.nullcontext
            with as_kept():
                want = ref.generate(**kwargs)
                ref_cache = _reference_cache(ref, want, mask)
            model = load_tp(dirs[name], rank, world)
            formats = {"kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"}
            cfg = {"kvpp": formats if fp8 else {}, "block_size": BS}
            model = torch_kvoffload.compile(model, cfg) if compiled else torch_kvoffload.offload(model, cfg)
            got = model.generate(**kwargs)
        session = session_of(model)
        stats = torch_kvoffload.stats(model)
        owned = list(session.kvpp_offload.plan.owned)
        # what this rank stores persistently: its owned layers' rows, per request (request r: blocks r*M..)
        rows_per_request = session.blocks_per_request * BS
        stored = {}
        for layer in owned:
            views = session.kvpp_offload.views(layer)
            if fp8:  # one component of FP8 rows: decoded with the FP8 attention's own decoder
                rows = views["kv_fp8"]
                assert rows.dtype == torch.uint8 and "c_kv" not in views
                kv_c, k_pe = dequantize_rows(rows.reshape(-1, rows.shape[-1]), session.spec.kv_lora_rank)
                flat = {"c_kv": kv_c, "k_pe": k_pe, "width": rows.shape[-1]}
            else:
                flat = {c: views[c].reshape(-1, views[c].shape[-1]) for c in ("c_kv", "k_pe")}
            stored[layer] = {
                c: [flat[c][b * rows_per_request :][: n + NEW - 1].clone() for b, n in enumerate(lengths)]
                for c in ("c_kv", "k_pe")
            }
            stored[layer]["width"] = flat.get("width")
        explained = torch_kvoffload.explain(model) if compiled else ""
        packed = {}
        if not compiled:  # then a packed forward (other shapes): each segment attends only to itself
            ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
            pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
            with torch.no_grad(), as_kept():
                packed["got"] = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                parts = [
                    ref(input_ids=ids[:, :5], use_cache=False),
                    ref(input_ids=ids[:, 5:], use_cache=False),
                ]
            packed["want"] = torch.cat([p.logits for p in parts], dim=1)
        again = {}
        if not compiled:  # the batch again: each rank takes its owned layers' stored blocks over
            before = torch_kvoffload.stats(model)["prefix_store_tokens"]
            with torch.no_grad():
                again["got"] = model.generate(**kwargs)
            again["reused"] = torch_kvoffload.stats(model)["prefix_store_tokens"] - before
        if not compiled and name == "v32":  # rank 1's store loses the blocks after its lookup: no rank
            before = torch_kvoffload.stats(model)  # takes them over (one family: the same path on both)
            with torch.no_grad(), store_emptied_after_each_lookup(active=rank == 1):
                again["lost"] = model.generate(**kwargs)
            after = torch_kvoffload.stats(model)
            again["lost_stats"] = {
                k: after[k] - before[k] for k in ("prefix_store_tokens", "prefix_fallbacks")
            }
        results[name] = {
            "want": want, "got": got, "stats": stats, "owned": owned, "tp": session.kvpp_config.tp_size,
            "explain": explained, "packed": packed, "graphs": len(getattr(model, "_kvoffload_compile_reports", [])),
            "stored": stored, "ref_cache": ref_cache, "heads": session.spec.num_heads, "again": again,
            "tp_ranks": session.spec.tp.ranks, "kvpp_ranks": session.kvpp_offload.scheduler.transport.group.ranks,
        }  # fmt: skip
        session.close()
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@contextlib.contextmanager
def _fp8_formats(model):
    """The unmodified ``model`` with both FP8 roundings: its latent KV and its indexer's scores."""
    with fp8_latent_kv(model), fp8_indexer():
        yield


def _reference_cache(model, tokens: torch.Tensor, mask: torch.Tensor) -> dict[int, dict[str, list]]:
    """Per layer, the unmodified model's cached latent ``c_kv`` (keys) and ``k_pe`` (values) of every
    request's real tokens, from one forward over the generated sequence less its last token."""
    B, new = tokens.shape[0], tokens.shape[1] - mask.shape[1]
    full_mask = torch.cat([mask, torch.ones(B, new - 1, dtype=mask.dtype)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=tokens[:, :-1], attention_mask=full_mask, position_ids=pos, use_cache=True)
    real = full_mask.bool()
    cache = out.past_key_values
    return {
        layer: {
            "c_kv": [cache.layers[layer].keys[b, 0][real[b]] for b in range(B)],
            "k_pe": [cache.layers[layer].values[b, 0][real[b]] for b in range(B)],
        }
        for layer in range(len(cache.layers))
    }


def _spec(family: str, overrides: dict, fp8: bool) -> tuple[int, int, int]:
    """``(layers, bytes per block of one layer bundle, bytes per token of HF's dense cache)`` written out
    from the tiny config (fp32; FP8 rows: the latent values' bytes, one fp32 scale per 128, bf16 RoPE)."""
    from support.hf_models import tiny_config

    cfg = tiny_config(family, **overrides)
    index_dim = cfg.index_head_dim if family == "deepseek_v32" else 0
    dense = (cfg.kv_lora_rank + cfg.qk_rope_head_dim + index_dim) * 4
    if not fp8:
        return cfg.num_hidden_layers, BS * dense, dense
    latent = cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // 128) + 2 * cfg.qk_rope_head_dim
    index = index_dim + 4 * (index_dim // 128)  # FP8 indexer rows: one fp32 scale per 128 values
    return cfg.num_hidden_layers, BS * (latent + index), dense


def _check(results: list[dict], name: str, family: str, overrides: dict, lengths: list[int]) -> None:
    from support.hf_models import tiny_config

    world = len(results)
    fp8 = name in FP8_CASES
    layers, bpb, dense_bpt = _spec(family, overrides, fp8)
    config = tiny_config(family, **overrides)
    heads = config.num_attention_heads
    # a TP plan with kv_b_proj colwise shards the attention heads (V3.2; V3 too from transformers 5.25 on),
    # one without leaves them replicated (V3 on 5.24)
    sharded = (config.base_model_tp_plan or {}).get("layers.*.self_attn.kv_b_proj") == "colwise"
    local_heads = heads // world if sharded else heads
    width = max(lengths)
    per_request = -(-(width + NEW) // BS)
    num_blocks = len(lengths) * per_request
    owned_sets = []
    for rank, res in enumerate(results):
        r = res[name]
        assert torch.equal(r["got"], r["want"]), (
            f"{name} rank {rank}: {(r['got'] != r['want']).sum()} tokens differ"
        )
        # contiguous balanced ownership: rank i owns layers [i*L/W, (i+1)*L/W)
        assert r["owned"] == list(range(rank * layers // world, (rank + 1) * layers // world))
        assert r["tp"] == world
        assert r["heads"] == local_heads
        assert r["tp_ranks"] == r["kvpp_ranks"] == tuple(range(world))
        owned_sets.append(set(r["owned"]))
        # the owned layers hold the model's KV of every token (HF's cache: keys = c_kv, values = k_pe)
        assert sorted(r["stored"]) == r["owned"]
        # FP8 rows: a value may round to the neighbouring FP8 code (3 mantissa bits: at most 2^-3 of it) where
        # this rank's sharded model computes the latent a rounding error away from the reference's
        tol = {"rtol": 2**-3, "atol": 1e-4} if fp8 else {"rtol": 1e-4, "atol": 1e-5}
        for layer, comps in r["stored"].items():
            assert comps.pop("width") == (
                kv_row_bytes(config.kv_lora_rank, config.qk_rope_head_dim) if fp8 else None
            )
            for comp, per_request in comps.items():
                for b, got_rows in enumerate(per_request):
                    want_rows = r["ref_cache"][layer][comp][b]
                    torch.testing.assert_close(got_rows, want_rows, **tol)
        s = r["stats"]
        persistent = len(r["owned"]) * bpb * num_blocks
        scratch = -(-(bpb * num_blocks) // SCRATCH_ALIGN) * SCRATCH_ALIGN
        assert s["kvpp_owned_layers"] == len(r["owned"])
        assert s["kvpp_persistent_bytes"] == persistent
        assert s["kvpp_scratch_bytes"] == 2 * scratch
        assert s["device_kv_bytes"] == persistent + 2 * scratch
        # a dense paged pool of the same blocks holds every layer: each rank keeps 1/W of it persistently
        assert persistent * world == layers * bpb * num_blocks
        # HF's dense cache for the same tokens: every layer, every position (padding included)
        seen = width + NEW - 1
        assert s["dense_kv_bytes"] == layers * len(lengths) * seen * dense_bpt
        # the first prefill has no history: nothing is broadcast; then every layer of every decode step
        assert s["forwards"] == NEW
        assert s["broadcasts"] == (NEW - 1) * layers
        # each broadcast was waited for once (the first prefill moved nothing: no wait)
        assert s["kvpp_waits"] == s["broadcasts"] and s["kvpp_wait_seconds"] >= 0
        assert (
            s["kvpp_broadcast_seconds"] > 0
        )  # every decode step broadcast something, on the transfer thread
        # decode step k moves, per layer, the blocks holding each request's first len + k - 1 tokens
        blocks = sum(-(-(n + k - 1) // BS) for k in range(1, NEW) for n in lengths)
        assert s["bytes_broadcast"] == layers * blocks * bpb
    assert set.union(*owned_sets) == set(range(layers)) and not set.intersection(*owned_sets)
    for r in results[1:]:
        assert torch.equal(r[name]["got"], results[0][name]["got"])
    for r in results:  # a packed forward after the generate: its segments are independent on every rank
        if r[name]["packed"]:
            torch.testing.assert_close(
                r[name]["packed"]["got"], r[name]["packed"]["want"], rtol=1e-4, atol=1e-4
            )
    # the batch again (eager): every rank took over the columns each row had cached in full blocks (its
    # owned layers' rows, read back after the first generate's forwards; at least one token computed)
    pads = [width - n for n in lengths]
    columns = min(p + (n - 1) // BS * BS for p, n in zip(pads, lengths, strict=True))
    adopted = sum(max(columns - p, 0) for p in pads)
    for r in results:
        again = r[name]["again"]
        if again:
            assert adopted > 0 and again["reused"] == adopted
            assert torch.equal(again["got"], r[name]["want"])
        if "lost" in again:  # one rank could not read what it found: every rank computed the prompts (the
            # others undid what they had taken over), the same tokens
            assert torch.equal(again["lost"], r[name]["want"])
            assert again["lost_stats"] == {"prefix_store_tokens": 0, "prefix_fallbacks": 1}


EAGER = [
    ("v3", "deepseek_v3", {}, [20, 13], False),
    ("v32", "deepseek_v32", {}, [20, 13], False),
]
# one compiled family keeps the run short (V3 differs from V3.2 only by the indexer on this path)
COMPILED = [("v32-compiled", "deepseek_v32", SMALL, [9, 13], True)]
# 4 ranks: one layer each; 4 heads split one per rank (V3.2, whose bundles also carry the indexer keys;
# both families run on two ranks); the latent KV and the indexer keys as FP8 rows (tiles of 128 values)
FOUR = [("v32-4-fp8", "deepseek_v32", {"kv_lora_rank": 128, "index_head_dim": 128}, [11, 6], False)]
FP8_CASES = {"v32-4-fp8"}


def _run(tmp_path_factory, world: int, cases: list[tuple]) -> list[dict]:
    """Every rank's results for ``cases``, from one spawn (process start-up dominates otherwise)."""
    out = tmp_path_factory.mktemp(f"kvpp{world}")
    dirs = {c[0]: save_tiny(c[1], out / c[0], **c[2]) for c in cases}
    spawn_gloo(_worker, world, cases, dirs, str(out), timeout=TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory, 2, EAGER + COMPILED)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _run(tmp_path_factory, 4, FOUR)


@pytest.mark.parametrize("case", EAGER, ids=[c[0] for c in EAGER])
def test_kvpp_two_tp_ranks_eager_tokens_and_bytes(two_ranks, case):
    name, family, overrides, lengths, _ = case
    _check(two_ranks, name, family, overrides, lengths)


@pytest.mark.parametrize("case", FOUR, ids=[c[0] for c in FOUR])
def test_kvpp_four_tp_ranks_eager_tokens_and_bytes(four_ranks, case):
    name, family, overrides, lengths, _ = case
    _check(four_ranks, name, family, overrides, lengths)


@pytest.mark.parametrize("case", COMPILED, ids=[c[0] for c in COMPILED])
def test_kvpp_two_tp_ranks_compiled_tokens_and_bytes(two_ranks, case):
    name, family, overrides, lengths, _ = case
    _check(two_ranks, name, family, overrides, lengths)
    for rank in two_ranks:
        text = rank[name]["explain"]
        layers = overrides["num_hidden_layers"]
        for layer in range(layers):
            assert f"layer {layer}:" in text
        # no KVPP hook ops in the graphs: the KV core waits for each layer's broadcast in cache_write
        # (the waits and broadcasts counted in _check), which starts the next one
        assert "kvpp_wait_layer" not in text and "kvpp_prefetch_layer" not in text
        assert text.count("mla_cache_attention") >= layers
        # prefill + decode graphs: the KVPP hooks add no recompile
        assert 1 <= rank[name]["graphs"] <= 3


# ---------------------------------------------------------------------------------- configuration


def test_kvpp_partial_config_is_resolved_against_the_model_and_group():
    from torch_kvoffload.integrations.hf import inspect_model
    from torch_kvoffload.kvpp.config import resolve_kvpp_config

    v3 = inspect_model(build_model("deepseek_v3", num_hidden_layers=2))
    v32 = inspect_model(build_model("deepseek_v32", num_hidden_layers=2))
    cfg = OffloadConfig(kvpp={})
    assert cfg.kvpp_requested
    got = resolve_kvpp_config(cfg.kvpp, v3, world_size=4)
    assert (got.enable_kvpp, got.tp_size, got.pcp_size, got.attention) == (True, 4, 1, "mla")
    assert resolve_kvpp_config(cfg.kvpp, v32, world_size=2).attention == "sfa"
    got = resolve_kvpp_config(
        OffloadConfig(kvpp={"tp_size": 2, "max_broadcast_runs": 3}).kvpp, v32, world_size=4
    )
    assert (got.tp_size, got.max_broadcast_runs) == (2, 3)
    assert resolve_kvpp_config(OffloadConfig(kvpp={"pcp_size": 2}).kvpp, v3, world_size=4).tp_size == 2
    with pytest.raises(ValueError, match=r"attention='mla'.*DeepseekV32ForCausalLM.*'sfa'"):
        resolve_kvpp_config(OffloadConfig(kvpp={"attention": "mla"}).kvpp, v32, world_size=2)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        resolve_kvpp_config(cfg.kvpp, v3, world_size=1)
    with pytest.raises(ValueError, match="cannot be split"):
        resolve_kvpp_config(OffloadConfig(kvpp={"tp_size": 2}).kvpp, v3, world_size=3)
    with pytest.raises(ValueError, match="KVPP is off"):
        resolve_kvpp_config(OffloadConfig(layerwise={}, kvpp={"enable_kvpp": False}).kvpp, v3, world_size=2)


def test_kvpp_group_of_a_tensor_parallel_model_is_its_tp_group():
    import dataclasses

    from torch_kvoffload.integrations.hf import inspect_model
    from torch_kvoffload.kv.spec import TensorParallel
    from torch_kvoffload.kvpp.backend import _check_tensor_parallel
    from torch_kvoffload.kvpp.config import resolve_kvpp_config

    spec = inspect_model(build_model("deepseek_v32", num_hidden_layers=2))
    assert spec.tp is None and spec.tp_size == 1 and spec.num_heads == spec.total_heads == 4
    tp = dataclasses.replace(spec, tp=TensorParallel(size=2, rank=0, ranks=(0, 1), group=None), num_heads=2)
    # tp_size defaults to the model's TP size, not the world's (here 4 ranks: 2 TP groups)
    got = resolve_kvpp_config(OffloadConfig(kvpp={}).kvpp, tp, world_size=4)
    assert (got.tp_size, got.pcp_size) == (2, 1)
    _check_tensor_parallel(tp, got)
    with pytest.raises(ValueError, match=r"tensor-parallel group of 2 ranks.*tp_size \* pcp_size = 4 \* 1"):
        _check_tensor_parallel(
            tp, resolve_kvpp_config(OffloadConfig(kvpp={"tp_size": 4}).kvpp, tp, world_size=4)
        )
    with pytest.raises(ValueError, match=r"2 \* 2; .*pcp_size at 1"):
        _check_tensor_parallel(
            tp, resolve_kvpp_config(OffloadConfig(kvpp={"pcp_size": 2}).kvpp, tp, world_size=4)
        )
    _check_tensor_parallel(
        spec, resolve_kvpp_config(OffloadConfig(kvpp={"tp_size": 4}).kvpp, spec, world_size=4)
    )


def test_kvpp_rejections_leave_nothing_registered():
    from torch_kvoffload.ops import kvpp, layer_hooks, mla_runtime

    names = (mla_runtime.runtimes.names(), layer_hooks.runtimes.names(), kvpp.runtimes.names())
    for other in ({"layerwise": {}}, {"sparse": {}}, {"layerwise": {}, "sparse": {}}):
        with pytest.raises(ValueError, match="kvpp cannot be combined with"):
            OffloadConfig(kvpp={}, **other)
    with pytest.raises(ValueError, match="nothing is enabled"):
        OffloadConfig(kvpp={"enable_kvpp": "false"})
    # explicitly disabled KVPP combines with anything
    assert not OffloadConfig(layerwise={}, kvpp={"enable_kvpp": False}).kvpp_requested
    v3 = build_model("deepseek_v3", num_hidden_layers=2)
    forward = v3.forward
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM.*KVPP needs torch.distributed"):
        torch_kvoffload.offload(v3, {"kvpp": {}})
    assert v3.forward == forward and not hasattr(v3, "_kvoffload_session")
    # FP8 latent rows: a format by name, and a kv_lora_rank of whole 128-value tiles (V3's tiny one is 64)
    with pytest.raises(ValueError, match="kv_dtype: expected None"):
        OffloadConfig(kvpp={"kv_dtype": "bf16"})
    with pytest.raises(ValueError, match=r"kvpp: kv_dtype='fp8_e4m3' .*kv_lora_rank=64"):
        torch_kvoffload.offload(v3, {"kvpp": {"kv_dtype": "fp8_e4m3"}})
    assert v3.forward == forward and not hasattr(v3, "_kvoffload_session")
    with pytest.raises(ValueError, match="indexer_dtype: expected None"):
        OffloadConfig(kvpp={"indexer_dtype": "int8"})
    v32 = build_model("deepseek_v32", num_hidden_layers=2)  # index_head_dim 32: not 128-wide groups
    with pytest.raises(ValueError, match=r"kvpp: indexer_dtype='fp8_e4m3' .*index_head_dim=32"):
        torch_kvoffload.offload(v32, {"kvpp": {"indexer_dtype": "fp8_e4m3"}})
    assert not hasattr(v32, "_kvoffload_session")
    assert OffloadConfig(kvpp={"indexer_dtype": "fp8_e4m3"}).fp8_indexer
    assert OffloadConfig(kvpp={"kv_dtype": "fp8_e4m3"}).fp8_kv
    assert not OffloadConfig(kvpp={"kv_dtype": "fp8_e4m3", "enable_kvpp": False}, sparse={}).fp8_kv
    assert (mla_runtime.runtimes.names(), layer_hooks.runtimes.names(), kvpp.runtimes.names()) == names

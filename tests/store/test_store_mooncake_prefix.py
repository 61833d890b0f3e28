"""Prefix reuse across processes: a process computes a prompt, another one with the same weights on the
same Mooncake store (a loopback master) computes only what the first did not. Models whose stored KV
cannot serve (other weights, another block size, another dtype) never hit.

Needs the Mooncake client and the ``mooncake_master`` binary (see ``support.mooncake``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from support.hf_models import build_model
from support.mooncake import mooncake_missing
from support.pd_helpers import hf_context

import torch_kvoffload
from torch_kvoffload.integrations.hf.install import detach

_MISSING = mooncake_missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

BS = 16
NEW = 4


def _config(master, *, segment: int | None, block_size: int = BS) -> dict:
    store = {
        "kind": "mooncake", "capacity_bytes": 32 << 20, "master_server_addr": master.master_addr,
        "metadata_server": master.metadata_server, "global_segment_size": segment,
    }  # fmt: skip
    return {"layerwise": {"store": store}, "sparse": {}, "block_size": block_size}


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


def _first_process(config: dict, ids: torch.Tensor, out) -> None:
    """Another process: the same weights, offloaded on the same store, generate the prompt (its blocks are
    put into the segment the test process lends: this process lends none)."""
    model = torch_kvoffload.offload(build_model("deepseek_v32"), config)
    tokens = _generate(model, ids)
    # plain values: a tensor would travel as a file descriptor this process must outlive
    out.put((tokens.tolist(), int(torch_kvoffload.stats(model)["prefix_store_tokens"])))
    detach(model)


def test_a_second_process_computes_only_what_the_first_did_not(master):
    ids = torch.randint(3, 1000, (1, 70), generator=torch.Generator().manual_seed(21))
    want = _generate(build_model("deepseek_v32"), ids)
    # this process lends the segment first, so the other one's blocks outlive it
    model = torch_kvoffload.offload(build_model("deepseek_v32"), _config(master, segment=None))
    ctx = hf_context()
    out = ctx.Queue()
    child = ctx.Process(target=_first_process, args=(_config(master, segment=0), ids, out))
    child.start()
    try:
        tokens, served = out.get(timeout=120)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and served == 0 and tokens == want.tolist()

    before = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, ids), want)
    after = torch_kvoffload.stats(model)
    assert after["prefix_store_tokens"] - before["prefix_store_tokens"] == 64  # 4 of its blocks
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 6

    # other weights, another block size, another dtype on the same store: nothing to reuse
    others = [
        (build_model("deepseek_v32", seed=1), _config(master, segment=0)),
        (build_model("deepseek_v32"), _config(master, segment=0, block_size=32)),
        (build_model("deepseek_v32", dtype=torch.bfloat16), _config(master, segment=0)),
    ]
    for other, config in others:
        ref = _generate(other, ids)
        other = torch_kvoffload.offload(other, config)
        try:
            got = _generate(other, ids)
            if (
                next(other.parameters()).dtype == torch.float32
            ):  # bf16: the absorbed attention rounds otherwise
                assert torch.equal(got, ref)
            assert torch_kvoffload.stats(other)["prefix_store_tokens"] == 0
        finally:
            detach(other)
    detach(model)

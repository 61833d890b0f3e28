"""The supported transformers releases: the check at ``offload`` / ``compile`` entry, the ``hf`` extra that
states the same range, and the continuous-batching module's import-time check of the names it overrides."""

from __future__ import annotations

import importlib
import tomllib

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from packaging.version import Version
from support import ROOT

import torch_kvoffload
from torch_kvoffload.integrations.hf import versions
from torch_kvoffload.integrations.hf.versions import (
    MAX_TRANSFORMERS,
    MIN_TRANSFORMERS,
    check_transformers_version,
    supported_range,
)


def test_the_installed_transformers_is_supported():
    assert Version(MIN_TRANSFORMERS) <= Version(transformers.__version__) <= Version(MAX_TRANSFORMERS)
    check_transformers_version()


@pytest.mark.parametrize("version", [MIN_TRANSFORMERS, MAX_TRANSFORMERS])
def test_both_ends_of_the_range_pass(monkeypatch, version):
    monkeypatch.setattr(transformers, "__version__", version)
    check_transformers_version()


@pytest.mark.parametrize("version", ["5.23.0", "5.26.0", "5.25.1", "4.57.6", "5.26.0.dev0"])
def test_a_release_outside_the_range_raises_naming_it_and_the_range(monkeypatch, version):
    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(
        RuntimeError, match=rf"transformers {version} is installed.*>={MIN_TRANSFORMERS},<={MAX_TRANSFORMERS}"
    ):
        check_transformers_version()


def test_an_unreadable_version_raises(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "not-a-version")
    with pytest.raises(RuntimeError, match="cannot read the installed transformers version 'not-a-version'"):
        check_transformers_version()


def test_the_check_is_cached_per_version():
    check_transformers_version()
    hits = versions._check.cache_info().hits
    check_transformers_version()
    assert versions._check.cache_info().hits == hits + 1


@pytest.mark.parametrize("entry", ["offload", "compile"])
def test_offload_and_compile_check_before_touching_the_model(monkeypatch, entry):
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    model = torch.nn.Linear(2, 2)
    forward = model.forward
    with pytest.raises(RuntimeError, match=r"transformers 5\.23\.0 is installed"):
        getattr(torch_kvoffload, entry)(model)
    assert model.forward == forward
    assert not hasattr(model, "_kvoffload_session")


def test_the_hf_extra_states_the_same_range():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"transformers{supported_range()}" in extras["hf"]


def test_continuous_batching_names_exist_and_a_missing_one_is_named(monkeypatch):
    cb = importlib.import_module("torch_kvoffload.integrations.hf.continuous_batching")
    cb._check_transformers_names()  # what the import ran
    assert set(cb.OVERRIDDEN) <= {(m, n) for m, n, _ in cb.TRANSFORMERS_NAMES}
    monkeypatch.setattr(
        cb,
        "TRANSFORMERS_NAMES",
        (*cb.TRANSFORMERS_NAMES, ("transformers.generation.continuous_batching.cache", "Renamed", ())),
    )
    with pytest.raises(
        ImportError, match=rf"continuous_batching\.cache\.Renamed.*{transformers.__version__}"
    ):
        cb._check_transformers_names()


def test_the_mla_allocator_of_transformers_525_is_overridden_where_it_exists():
    cb = importlib.import_module("torch_kvoffload.integrations.hf.continuous_batching")
    name = ("transformers.generation.continuous_batching.cache", "MLACacheAllocator")
    has_it = hasattr(importlib.import_module(name[0]), name[1])
    assert has_it == (Version(transformers.__version__) >= Version("5.25.0"))
    assert (name in cb.OVERRIDDEN) == has_it


def test_an_enabled_deepseek_v3_runs_the_library_allocator_not_the_one_of_transformers(monkeypatch):
    """transformers 5.25 builds its own MLA allocator for a DeepSeek-V3 unless ``cache.MLACacheAllocator`` is
    overridden too; the library's allocator must be the one written to."""
    from support.hf_models import SMALL, build_model
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb = importlib.import_module("torch_kvoffload.integrations.hf.continuous_batching")
    layers = []
    update = cb.MLACacheAllocator.update

    def counting_update(self, key_states, value_states, layer_idx, *args):
        layers.append(layer_idx)
        return update(self, key_states, value_states, layer_idx, *args)

    monkeypatch.setattr(cb.MLACacheAllocator, "update", counting_update)
    model = build_model("deepseek_v3", **SMALL)
    cb.enable_mla_continuous_batching(model)
    gen = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=999_999, pad_token_id=0)
    out = model.generate_batch(
        [[5, 6, 7]],
        generation_config=gen,
        continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=4),
    )
    assert all(r.error is None for r in out.values())
    assert set(layers) == set(range(model.config.num_hidden_layers))

"""Test helpers for models loaded with transformers' tensor parallelism: a tiny model saved to a directory,
loaded back on every rank of a gloo group with ``tp_plan="auto"`` (``DistributedConfig(tp_plan="auto")``, the
form transformers 5.24 asks for)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from support.hf_models import build_model

__all__ = ["load_tp", "save_tiny"]


def save_tiny(family: str, directory: str | Path, **overrides: Any) -> str:
    """Save the seeded tiny ``family`` model (:func:`hf_models.build_model`) to ``directory``; returns it.
    ``build_model(family, **overrides)`` in any process gives the same weights: the single-process reference."""
    build_model(family, **overrides).save_pretrained(str(directory))
    return str(directory)


def load_tp(directory: str, rank: int, world: int) -> torch.nn.Module:
    """The model saved in ``directory`` loaded with ``tp_plan="auto"`` on this rank of an initialised
    process group of ``world`` ranks (transformers reads the rank from the environment)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    config = DistributedConfig(tp_size=world, tp_plan="auto")  # the form transformers 5.24 asks for
    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=config)
    assert getattr(model, "_tp_size", 1) == world, (
        f"transformers loaded the model with tp_size {model._tp_size}"
    )
    return model.eval()

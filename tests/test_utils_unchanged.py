"""``Unchanged``: a tensor watched by its version counter, or an inference tensor by its values."""

from __future__ import annotations

import torch

from torch_kvoffload._utils import Unchanged


def test_a_modified_or_other_tensor_is_not_unchanged():
    t = torch.arange(4)
    w = Unchanged(t)
    assert w.holds(t) and not w.holds(torch.arange(4))  # another tensor with the same values
    t.add_(0)  # an in-place op bumps the version even when the values stay
    assert not w.holds(t)


def test_inference_tensors_are_compared_by_value():
    with torch.inference_mode():
        t = torch.arange(4)
    w = Unchanged(t)
    assert w.holds(t)
    with torch.inference_mode():
        t[1] = 7
    assert not w.holds(t)
    with torch.inference_mode():
        t[1] = 1  # the values it was watched with again
    assert w.holds(t)

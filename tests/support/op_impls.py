"""The implementations an op test runs against (the dispatcher's kernel, the Triton kernel, the pure-PyTorch
reference) and how to call each on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload.ops import has_kernel, reference_kernel
from torch_kvoffload.ops.triton import interpreting, triton_available, triton_kernel


def cpp_kernel_available(op: str) -> bool:
    """Whether op ``op`` has a C++ CPU kernel registered (asks the dispatcher, not the environment)."""
    return has_kernel(op, "CPU")


requires_cpp = pytest.mark.skipif(
    not cpp_kernel_available("copy_rows"), reason="C++ extension not built / disabled"
)

#: Implementations an op suite runs against: the dispatcher's kernel for the tensors' device (the C++
#: kernel on CPU, the registered device kernel on an accelerator) and the Triton kernel called directly
#: (on the CPU tensors under the interpreter, on CUDA copies of them when a CUDA device is present).
OP_IMPLS = ("dispatch", "triton")


def triton_device() -> torch.device | None:
    """Where the ``"triton"`` variant runs the kernels: ``None`` for the CPU tensors themselves (under
    ``TRITON_INTERPRET=1``), ``cuda`` for CUDA copies of them (interpreter off, a CUDA device present).

    Raises ``pytest.skip.Exception`` when the Triton kernels cannot run here at all.
    """
    if not triton_available():
        pytest.skip("triton is not importable (install the test extra)")
    if interpreting():
        return None
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("the Triton kernels need a CUDA device or TRITON_INTERPRET=1 (CPU tensors)")


def skip_unusable(impl: str) -> None:
    """Skip the test when implementation ``impl`` cannot run here."""
    if impl == "triton":
        triton_device()


class _DeviceMirror:
    """Device copies of CPU tensors that keep their layout and aliasing: each distinct CPU storage is
    copied once, whole, and every tensor on it becomes a view with the same offset, sizes and strides
    (overlapping views, a source that aliases the destination, odd storage offsets stay as they were)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._storages: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def to_device(self, value):
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                return value
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in self._storages:
                host = torch.empty(0, dtype=torch.uint8).set_(storage)
                self._storages[key] = (host, host.to(self.device, copy=True))
            dev_bytes = self._storages[key][1]
            view = torch.empty(0, dtype=value.dtype, device=self.device)
            return view.set_(dev_bytes.untyped_storage(), value.storage_offset(), value.shape, value.stride())
        if isinstance(value, (list, tuple)):
            return type(value)(self.to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: self.to_device(v) for k, v in value.items()}
        return value

    def copy_back(self) -> None:
        """Write every device storage back over its CPU storage (the outputs; inputs come back unchanged)."""
        for host, dev_bytes in self._storages.values():
            host.copy_(dev_bytes)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def run_triton(fn, *args, **kwargs):
    """Call the Triton wrapper ``fn`` on CPU arguments: directly under the interpreter, or on CUDA copies
    whose mutations come back into the CPU tensors (also after an error, so a rejected call that wrote
    anything is caught) and whose results come back as CPU tensors; errors propagate unchanged."""
    device = triton_device()
    if device is None:
        return fn(*args, **kwargs)
    mirror = _DeviceMirror(device)
    dev_args, dev_kwargs = mirror.to_device(args), mirror.to_device(kwargs)
    try:
        result = fn(*dev_args, **dev_kwargs)
        torch.cuda.synchronize(device)
    finally:
        mirror.copy_back()
    return _to_cpu(result)


def call_op(op_impl: str, name: str, *args, **kwargs):
    """Run op ``name`` through ``op_impl``: ``torch.ops.kvoffload.<name>``, its Triton kernel, or (for
    ``"reference"``) its pure-PyTorch reference kernel.

    Arguments are CPU tensors. The Triton kernel takes them as they are under ``TRITON_INTERPRET=1``;
    otherwise (a CUDA device) it runs on device copies with the same layout and aliasing, and every CPU
    tensor argument then holds what the kernel left in its copy.
    """
    if op_impl == "dispatch":
        return getattr(torch.ops.kvoffload, name)(*args, **kwargs)
    if op_impl == "triton":
        return run_triton(triton_kernel(name), *args, **kwargs)
    if op_impl == "reference":
        return reference_kernel(name)(*args, **kwargs)
    raise ValueError(f"call_op: unknown op_impl {op_impl!r}; expected one of {(*OP_IMPLS, 'reference')}")


def skip_unless_kernel(op_impl: str, name: str) -> None:
    """Skip a kernel-vs-reference test whose ``"dispatch"`` variant would only run the reference itself.

    On CPU without the C++ kernel the dispatcher falls back to the reference kernel; comparing it with
    the reference proves nothing, so the test skips.
    """
    if op_impl == "dispatch" and not has_kernel(name, "CPU"):
        pytest.skip(f"C++ CPU kernel of {name} not built / disabled")


def assert_refused_before_launch(
    name: str, args: tuple, monkeypatch: pytest.MonkeyPatch, module: object, launchers: tuple[str, ...]
) -> None:
    """The Triton kernel of op ``name`` refuses ``args`` as the reference kernel does (same exception type
    and message, naming the op) before any of ``module``'s ``launchers`` runs."""

    def no_launch(*a, **k):
        raise AssertionError("launched a kernel on invalid input")

    for launcher in launchers:
        monkeypatch.setattr(module, launcher, no_launch)
    with pytest.raises(Exception) as want:
        reference_kernel(name)(*args)
    with pytest.raises(want.type) as got:
        run_triton(triton_kernel(name), *args)
    assert str(got.value) == str(want.value)
    assert f"kvoffload::{name}:" in str(got.value)

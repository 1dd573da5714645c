"""CheckingGraphBackend: a stand-in for CUDA graph capture that proves a step is graph-safe, on any device.

What it is: the capture backend the CPU tests (and `gpu_check.py --dry-run`) give the decode graph path
(cairn/decode_graphs.py) in place of cairn.ops.cuda_graphs.CudaGraphBackend. It is NOT a graph and
makes nothing faster: every replay runs the step again, eagerly. What it checks is what a real CUDA
graph freezes at capture, so a step that passes it replays correctly under one:

- at capture it records the step's ATen op sequence (a TorchDispatchMode): each op's name, its
  non-tensor arguments (ints, floats, shapes: a kernel's launch arguments) and for every tensor its
  shape and dtype, plus, for a tensor that lies in a registered static buffer (the runner's static
  inputs, the KV and state pools, the weights), that buffer's name and the offset and strides into it;
- it fails at once on a host sync or host read: `aten._local_scalar_dense` (`.item()`, `int(t)`),
  `aten.equal`, `nonzero`, `bincount`, ..., and (a TorchFunctionMode) `.tolist()`, `.numpy()`,
  `.cpu()`, `bool(t)`: a graph cannot wait for the device, and a value read on the host would be frozen;
- it fails on a tensor read that is neither a registered buffer nor the output of an earlier op of the
  step (a tensor built from host data with `torch.tensor(...)`, or one kept from an earlier step): a
  graph would read what that memory held at capture;
- at every replay it records again and asserts the same sequence, the same arguments and the same
  static pointers (so a shape, a scalar or a branch chosen from the step's host values fails), then
  copies the result into the output tensor of the capture and returns that tensor, as a graph would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class GraphUnsafe(RuntimeError):
    """The step does something a CUDA graph cannot replay faithfully (the message says what, and at which op)."""


# ATen ops that wait for the device or give an output whose shape depends on the data
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::nonzero",
                      "aten::masked_select", "aten::bincount", "aten::unique_dim", "aten::_unique", "aten::_unique2",
                      "aten::unique_consecutive", "aten::allclose", "aten::masked_scatter"})
# Tensor methods that read values on the host (on a CPU tensor they dispatch no ATen op)
HOST_READS = frozenset({"tolist", "numpy", "item", "cpu", "__bool__", "__int__", "__float__", "__index__"})


class _HostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            raise GraphUnsafe(f"Tensor.{name}() reads a value on the host: a CUDA graph would freeze it")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records one run of a step: a list of (op, argument descriptors, output descriptors)."""

    def __init__(self, static: dict[int, str], device: torch.device):
        super().__init__()
        self.static, self.device = static, device  # storage address -> buffer name
        self.produced: set[int] = set()  # storages written by ops of this run
        self.alive: list[torch.Tensor] = []  # outputs kept until the end, so no address is reused meanwhile
        self.ops: list[tuple] = []

    def _tensor(self, op: str, t: torch.Tensor, is_input: bool) -> tuple:
        if t.device != self.device:
            raise GraphUnsafe(f"{op} touches a tensor on {t.device}, the graph's device is {self.device}: a copy "
                              "between devices the graph would wait for")
        meta = (tuple(t.shape), t.dtype)
        if t.numel() == 0:
            return ("empty", *meta)
        address = t.untyped_storage().data_ptr()
        if address in self.static:
            return ("static", self.static[address], t.storage_offset(), tuple(t.stride()), *meta)
        if is_input and address not in self.produced:
            raise GraphUnsafe(f"{op} reads a tensor {meta} that is neither a static buffer, a pool, a weight nor "
                              "the output of an earlier op of the step: a CUDA graph would read what its memory "
                              "held at capture")
        return ("tmp", *meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.name()
        if op.split(".")[0] in SYNC_OPS:
            raise GraphUnsafe(f"{op} waits for the device or sizes its output from the data: not graph-safe")
        inputs = tuple(self._tensor(op, a, True) if isinstance(a, torch.Tensor) else repr(a)
                       for a in _leaves((args, kwargs)))
        out = func(*args, **kwargs)
        outputs = [o for o in _leaves(out) if isinstance(o, torch.Tensor)]
        for o in outputs:
            self.produced.add(o.untyped_storage().data_ptr())
            self.alive.append(o)
        self.ops.append((op, inputs, tuple(self._tensor(op, o, False) for o in outputs)))
        return out


def _leaves(x) -> list:
    """The tensors and scalars inside nested tuples, lists and dicts (an op's arguments or outputs), in order."""
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in _leaves(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in _leaves(item)]
    return [x]


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"op {i}: captured {x}, replayed {y}"
    return f"captured {len(a)} ops, replayed {len(b)}"


class CheckingGraphBackend:
    """A checking stand-in for CUDA graphs (see the module docstring): same interface as CudaGraphBackend.

    `captures` and `replays` count the calls, `records` keeps each capture's op sequence (for tests)."""

    name = "checking stand-in (not a CUDA graph)"

    def __init__(self):
        self.captures = self.replays = 0
        self.records: list[list[tuple]] = []

    def capture(self, step: Callable[[], torch.Tensor], static: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm the step up once, record it, and return its replay. `static`: every tensor the step may read
        that is not computed in it, by name (weights, pools, static inputs)."""
        by_address: dict[int, str] = {}
        for name, t in static.items():
            by_address.setdefault(t.untyped_storage().data_ptr(), name)
        device = next(iter(static.values())).device
        step()  # the warm-up run, as a CUDA graph needs (lazy initialisations happen here, outside the record)
        record, out = self._record(step, by_address, device)
        self.records.append(record)
        self.captures += 1

        def replay() -> torch.Tensor:
            again, result = self._record(step, by_address, device)
            if again != record:
                difference = _first_difference(record, again)[:2000]
                raise GraphUnsafe(f"the replayed step differs from the captured one: {difference}")
            self.replays += 1
            with torch.inference_mode():  # the output was made in the model's inference mode
                return out.copy_(result)

        return replay

    @staticmethod
    def _record(step: Callable[[], torch.Tensor], static: dict[int, str],
                device: torch.device) -> tuple[list[tuple], torch.Tensor]:
        recorder = _Recorder(static, device)
        with _HostReads(), recorder:
            out = step()
        return recorder.ops, out

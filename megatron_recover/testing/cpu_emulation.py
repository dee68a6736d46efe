"""Run unmodified megatron-core on a machine without CUDA, for tests and the CPU demo only.

Contract:

- Opt-in and process-wide: nothing changes until `enable_cpu_emulation()` is called, and
  `disable_cpu_emulation()` restores every patched attribute exactly.
- Never with a GPU: enabling raises RuntimeError when `torch.cuda.is_available()` is true, so a
  real GPU job can never silently train on the CPU. `torch.cuda.is_available()` keeps returning
  False while emulation is on; code can still tell it is not on a GPU.
- Device redirection: tensors that megatron-core asks for on "cuda", "cuda:N",
  `torch.device("cuda")` or a bare ordinal (`device=torch.cuda.current_device()`) are created on
  the CPU, through the torch factory functions and `Tensor` methods in `_FACTORIES` /
  `_TENSOR_METHODS`.
- Placement (`on_device`): the emulation records which storages stand for device memory
  (`_placement`). `.cuda()` and `.to("cuda")` of a tensor already placed return it, as torch does
  for a move to the device a tensor is on; of a host tensor they return a placed copy and leave
  the host tensor where it was, as a GPU does. So a program that forgets to move its model or a
  batch trains on host tensors that `on_device` reports, and a CPU test can fail on it
  (tests/unit/test_device_discipline.py). `.cpu()` of a placed tensor returns it (no copy).
  `Tensor.type()` reports the CUDA type name ("torch.cuda.FloatTensor") because under emulation the
  CPU is the CUDA device, and megatron-core asserts on that string (gradient clipping, the
  float16 and distributed optimizers).
- `torch.cuda` stand-ins: see `_cuda_standins`, whose docstring says why each one is safe. Other
  CUDA APIs keep failing (those in `torch.cuda` itself with a RuntimeError naming the function),
  instead of pretending to run on a device that is not there.
- megatron-core's MoE token dispatcher moves its split sizes to the host with
  `maybe_move_tensor_to_cpu`, which tests `tensor.is_cuda`: False for the host storage that
  stands for device memory, so the sizes would stay tensors, which `all_to_all_single` refuses.
  Those sizes are computed on the device on a GPU (here, from placed tensors, into storages
  not marked placed): the stand-in gives their numpy copy, as the GPU path does.
- Threads: the patches are module attributes, so they hold for every thread.

Emulation may be enabled before or after megatron-core is imported: it patches names that are
looked up at call time (`torch.empty`, `torch.Tensor.to`, `torch.cuda.current_device`, ...). Code
that bound one by name earlier (`from torch import empty`) would not see the patch. megatron-core
(0.16.1 and 0.19.0) does that, outside Megatron FSDP, only with `torch.cuda._lazy_call` /
`_lazy_init` (tensor_parallel/random.py),
which is why the stand-in replaces `torch.cuda.is_initialized`, the global that `_lazy_call`
consults on every call.
"""

import contextlib
import functools
import logging
import sys

import torch

from megatron_recover.testing import _cuda_standins as standins
from megatron_recover.testing._placement import Placements

# The torch factory functions that take a `device=` keyword. megatron-core creates its buffers,
# masks, RNG seeds and communication tensors through these.
_FACTORIES = (
    "arange", "as_tensor", "asarray", "empty", "empty_like", "empty_strided", "eye", "full",
    "full_like", "linspace", "logspace", "normal", "ones", "ones_like", "rand", "rand_like",
    "randint", "randint_like", "randn", "randn_like", "randperm", "range", "scalar_tensor",
    "tensor", "tril_indices", "triu_indices", "zeros", "zeros_like",
)
# Tensor methods that create tensors on a `device=` keyword.
_TENSOR_METHODS = ("new_empty", "new_full", "new_ones", "new_tensor", "new_zeros")

# megatron's RNG tracker warns when the CPU RNG moves inside a CUDA RNG fork. Under emulation the
# CUDA generator is the CPU generator, so the warning fires by construction and says nothing.
_RNG_FORK_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"

_MISSING = object()
_active = None


def is_enabled() -> bool:
    """Whether CPU emulation is on in this process."""
    return _active is not None


def on_device(tensor: torch.Tensor) -> bool:
    """Whether `tensor` was placed on an emulated device (created there, moved there, or a view
    or `clone()` of such a tensor). Raises RuntimeError when emulation is off."""
    if _active is None:
        raise RuntimeError("CPU emulation is not enabled: a tensor's place is its .device")
    return _active.placements.on_device(tensor)


def enable_cpu_emulation(device_count: int = 1) -> None:
    """Turn CPU emulation on for this process (see the module docstring for the contract).

    `device_count` is the number of emulated CUDA devices (each one is the host CPU); a launcher
    whose ranks call `torch.cuda.set_device(local_rank)` needs one per local rank.
    Raises RuntimeError when CUDA is available or emulation is already on.
    """
    global _active
    if torch.cuda.is_available():
        raise RuntimeError(
            "CPU emulation refused: CUDA is available on this machine. Run megatron-core on the "
            "GPU; the emulation exists only for tests and demos on machines without one."
        )
    if _active is not None:
        raise RuntimeError("CPU emulation is already enabled in this process")
    emulation = _Emulation(standins.EmulatedDevices(device_count))
    emulation.apply()
    _active = emulation


def disable_cpu_emulation() -> None:
    """Restore every attribute emulation patched. Raises RuntimeError when it is not enabled."""
    global _active
    if _active is None:
        raise RuntimeError("CPU emulation is not enabled")
    _active.restore()
    _active = None


@contextlib.contextmanager
def cpu_emulation_enabled(device_count: int = 1):
    """`enable_cpu_emulation()` for the duration of a `with` block."""
    enable_cpu_emulation(device_count)
    try:
        yield
    finally:
        disable_cpu_emulation()


class _DropRngForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_FORK_WARNING


class _Emulation:
    """The set of patches one `enable_cpu_emulation()` applied, and how to undo them."""

    def __init__(self, devices: standins.EmulatedDevices):
        self.devices = devices
        self.placements = Placements()
        self.streams = standins.StreamRegistry()
        self.log_filter = _DropRngForkWarning()
        self.saved = []

    def apply(self) -> None:
        for owner, name, replacement in self._patches():
            self.saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, replacement)
        logging.getLogger(_RNG_FORK_LOGGER).addFilter(self.log_filter)

    def restore(self) -> None:
        logging.getLogger(_RNG_FORK_LOGGER).removeFilter(self.log_filter)
        for owner, name, original in reversed(self.saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved.clear()

    def _patches(self):
        """(owner, attribute, replacement) for every attribute emulation sets."""
        to_host, placements = self._to_host, self.placements
        patches = [
            (owner, name, _redirect_device_kwarg(getattr(owner, name), to_host, placements,
                                                 inherits=owner is torch.Tensor
                                                 or name.endswith("_like")))
            for owner, names in ((torch, _FACTORIES), (torch.Tensor, _TENSOR_METHODS))
            for name in names
        ]
        patches += [
            (torch.Tensor, "to", _redirect_to(torch.Tensor.to, to_host, placements)),
            (torch.Tensor, "cuda", _redirect_cuda(torch.Tensor.to, self.devices, placements)),
            (torch.Tensor, "clone", _placed_like_source(torch.Tensor.clone, placements)),
            (torch.Tensor, "type", _report_cuda_type(torch.Tensor.type)),
        ]
        return patches + self._cuda_module_patches() + self._megatron_patches()

    def _megatron_patches(self):
        """The device-to-host move of megatron-core's MoE dispatcher (module docstring)."""
        try:
            from megatron.core.transformer.moe import token_dispatcher
        except ImportError:
            return []
        return [(token_dispatcher, "maybe_move_tensor_to_cpu",
                 _splits_to_host(token_dispatcher.maybe_move_tensor_to_cpu))]

    def _cuda_module_patches(self):
        devices, streams = self.devices, self.streams
        rng = {
            "get_rng_state": standins.get_rng_state,
            "get_rng_state_all": standins.get_rng_state_all,
            "set_rng_state": standins.set_rng_state,
            "set_rng_state_all": standins.set_rng_state_all,
            "manual_seed": standins.manual_seed,
            "manual_seed_all": standins.manual_seed,
            "seed": standins.seed,
            "seed_all": standins.seed,
            "initial_seed": standins.initial_seed,
        }
        memory = {
            "memory_allocated": standins.zero_bytes,
            "max_memory_allocated": standins.zero_bytes,
            "memory_reserved": standins.zero_bytes,
            "max_memory_reserved": standins.zero_bytes,
            "memory_stats": standins.memory_stats,
            "empty_cache": standins.no_memory_to_manage,
            "reset_peak_memory_stats": standins.no_memory_to_manage,
        }
        cuda = {
            "current_device": devices.current_device,
            "device_count": devices.device_count,
            "set_device": devices.set_device,
            "default_generators": (torch.default_generator,) * devices.count,
            "is_initialized": standins.is_initialized,
            "_lazy_init": _refuse_unemulated_call,
            "synchronize": standins.synchronize,
            "Stream": standins.Stream,
            "Event": standins.Event,
            "stream": streams.stream,
            "current_stream": streams.current_stream,
            "default_stream": streams.default_stream,
            "set_stream": streams.set_stream,
            **rng,
            **memory,
        }
        return (
            [(torch.cuda, name, value) for name, value in cuda.items()]
            + [(torch.cuda.random, name, value) for name, value in rng.items()]
            + [(torch.cuda.memory, name, value) for name, value in memory.items()]
            + [(torch.cuda.nvtx, "_nvtx", standins.NoopNvtx())]
        )

    def _to_host(self, device):
        """`device` itself, or "cpu" when it names an emulated CUDA device (checked to exist)."""
        if _names_cuda(device):
            self.devices.index_of(device)
            return "cpu"
        return device


def _names_cuda(device) -> bool:
    """True for "cuda", "cuda:N", torch.device("cuda", ...) and a bare ordinal (int)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


def _redirect_device_kwarg(function, to_host, placements, inherits: bool):
    """Wrap a factory so that a CUDA `device=` keyword becomes the host and its result is
    placed. `inherits`: without a device, the result is where the first argument is (`*_like`
    factories, `Tensor.new_*` methods)."""

    @functools.wraps(function)
    def redirected(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = to_host(device)
            placed = _names_cuda(device)
        else:
            placed = (inherits and args and isinstance(args[0], torch.Tensor)
                      and placements.on_device(args[0]))
        result = function(*args, **kwargs)
        return placements.mark(result) if placed else result

    return redirected


def _to_device(original_to, placements, tensor, *args, **kwargs):
    """A move of `tensor` to an emulated device: itself (converted as asked) when it is placed
    already, else a placed copy, as a host-to-device copy is on a GPU."""
    if placements.on_device(tensor):
        moved = original_to(tensor, "cpu", *args, **kwargs)
    else:
        moved = original_to(tensor, "cpu", *args, **{**kwargs, "copy": True})
    return placements.mark(moved)


def _redirect_to(original_to, to_host, placements):
    """Wrap `Tensor.to`, whose device may also come first positionally (`t.to("cuda", dtype)`)
    or as a tensor whose device to take (`t.to(other)`)."""

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        device = kwargs.pop("device", None)
        if device is None and args and isinstance(args[0], (str, int, torch.device)):
            device, args = args[0], args[1:]
        elif device is None and args and isinstance(args[0], torch.Tensor):
            other = args[0]
            if placements.on_device(other):
                return _to_device(original_to, placements, self, other.dtype, *args[1:],
                                  **kwargs)
            return original_to(self, *args, **kwargs)
        if device is not None and _names_cuda(device):
            to_host(device)  # the ordinal exists
            return _to_device(original_to, placements, self, *args, **kwargs)
        if device is not None:
            return original_to(self, device, *args, **kwargs)
        converted = original_to(self, *args, **kwargs)  # a dtype conversion stays where it is
        if converted is not self and placements.on_device(self):
            placements.mark(converted)
        return converted

    return to


def _redirect_cuda(original_to, devices, placements):
    """`Tensor.cuda(device)`: check the ordinal, then as `.to("cuda")`."""

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        if device is not None:
            devices.index_of(device)
        return _to_device(original_to, placements, self, non_blocking=non_blocking,
                          memory_format=memory_format)

    cuda.__doc__ = torch.Tensor.cuda.__doc__
    return cuda


def _placed_like_source(method, placements):
    """A tensor method whose result is on its tensor's device (`clone`)."""

    @functools.wraps(method)
    def placed_like(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        return placements.mark(result) if placements.on_device(self) else result

    return placed_like


def _report_cuda_type(original_type):
    """`Tensor.type()` with no argument names the CUDA type; conversions are left to torch."""

    @functools.wraps(original_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return original_type(self).replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    return type_


def _splits_to_host(original):
    """megatron-core's maybe_move_tensor_to_cpu, converting to numpy where the GPU path does."""

    @functools.wraps(original)
    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):  # computed on the device on a GPU
            return tensor.detach().numpy().copy()
        # Otherwise the tensor stays: `.cpu()` of a placed tensor returns it (module docstring).
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def _refuse_unemulated_call(*args, **kwargs):
    """Stands in for `torch.cuda._lazy_init`, which every CUDA API we do not emulate calls first."""
    caller = sys._getframe(1).f_code.co_name
    raise RuntimeError(
        f"torch.cuda.{caller} is not covered by megatron_recover's CPU emulation "
        "(megatron_recover/testing/cpu_emulation.py); add a stand-in there if megatron needs it"
    )

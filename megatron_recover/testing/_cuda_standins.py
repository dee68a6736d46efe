"""Host-side stand-ins for the `torch.cuda` calls megatron-core makes (used by `cpu_emulation`).

Each stand-in keeps the signature of the `torch.cuda` function it replaces and gives the answer a
single-host "device" would give. The emulated node has `device_count` devices; every one of them
is the host CPU, and tensors "on" any of them are ordinary CPU tensors.

Why each group is safe:

- Devices (`current_device`, `device_count`, `set_device`): only bookkeeping of an index. Invalid
  ordinals raise as CUDA would, so a rank-to-device mistake still shows up.
- Synchronization (`synchronize`, `Stream`, `Event`, `stream`, `current_stream`,
  `default_stream`, `set_stream`): CPU kernels run synchronously, in program order, on the calling
  thread, so every ordering a stream or event expresses already holds when the call returns.
  What this does NOT cover: asynchronous gloo collectives finish on gloo's threads and are only
  complete after `Work.wait()` (megatron-core always waits its handles before using a result; on
  a GPU, `synchronize()` would also have waited for an NCCL kernel, here it does not).
- Random numbers (`get_rng_state`, `set_rng_state`, `manual_seed`, `default_generators`, ...):
  the CUDA generator of every emulated device IS the CPU default generator, because dropout and
  `init_method` on the emulated device draw from it. So megatron's `CudaRNGStatesTracker.fork()`
  really selects the stream that dropout uses, as on a GPU. The price: seeding "CUDA" reseeds the
  CPU stream, which on a GPU are independent.
- Memory counters (`memory_allocated`, `max_memory_reserved`, `memory_stats`, ...): the emulated
  device has no allocator of its own; its tensors live in host memory, which these counters do not
  track, so they report 0 bytes. `empty_cache` and `reset_peak_memory_stats` have nothing to do.
- NVTX ranges: profiler annotations only; they have no effect on results.
"""

import time

import torch


class EmulatedDevices:
    """The emulated node: `count` devices, all the host CPU, and the current device index."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"device_count must be at least 1, got {count}")
        self.count = count
        self.current = 0

    def index_of(self, device) -> int:
        """Return the ordinal `device` names (int, "cuda", "cuda:N", torch.device("cuda", N)).

        A device without an index means the current device. Raises RuntimeError for an ordinal
        this node does not have, as CUDA does ("invalid device ordinal").
        """
        if isinstance(device, int):
            index = device
        else:
            index = torch.device(device).index
            if index is None:
                index = self.current
        if not 0 <= index < self.count:
            raise RuntimeError(
                f"CUDA error: invalid device ordinal {index} "
                f"(CPU emulation has {self.count} device(s))"
            )
        return index

    def current_device(self) -> int:
        return self.current

    def device_count(self) -> int:
        return self.count

    def set_device(self, device) -> None:
        if isinstance(device, (str, torch.device)):
            if torch.device(device).type != "cuda":
                raise ValueError(f"set_device expects a CUDA device, got {device!r}")
        self.current = self.index_of(device)


def synchronize(device=None) -> None:
    """No-op: CPU work issued by this thread has already completed (see module docstring)."""


def is_initialized() -> bool:
    """True: torch's `_lazy_call` then runs RNG callbacks at once instead of queueing them.

    megatron's `_set_cuda_rng_state` goes through `torch.cuda._lazy_call`, which queues the callback
    until CUDA initializes; without CUDA that never happens, so the RNG tracker would silently stop
    switching states.
    """
    return True


class Event:
    """A CUDA event on the host: records a wall-clock time; every wait is already satisfied."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self._recorded_at_s = None

    def record(self, stream=None) -> None:
        self._recorded_at_s = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between this event and `end_event`; both timed and recorded, as in CUDA."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        if self._recorded_at_s is None or end_event._recorded_at_s is None:
            raise RuntimeError("Both events must be recorded before calling elapsed_time()")
        return (end_event._recorded_at_s - self._recorded_at_s) * 1000.0


class Stream:
    """A CUDA stream on the host: host work is already ordered, so waits return at once."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device
        self.priority = priority

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class StreamRegistry:
    """Which emulated stream is current, so `current_stream()` reflects `with stream(s)`."""

    def __init__(self):
        self.default = Stream()
        self.current = self.default

    def current_stream(self, device=None) -> Stream:
        return self.current

    def default_stream(self, device=None) -> Stream:
        return self.default

    def set_stream(self, stream: Stream) -> None:
        if stream is not None:
            self.current = stream

    def stream(self, stream: Stream) -> "StreamContext":
        return StreamContext(self, stream)


class StreamContext:
    """`torch.cuda.stream(s)`: makes `s` current inside the block; `None` is a no-op.

    A class rather than a generator, because torch's StreamContext can be entered more than once
    and megatron-core relies on it (param_and_grad_buffer.py enters one `stream_context` twice when
    there are several distributed-optimizer instances).
    """

    def __init__(self, registry: StreamRegistry, stream: Stream):
        self.registry = registry
        self.stream = stream
        self.previous = None

    def __enter__(self) -> Stream:
        self.previous = self.registry.current
        self.registry.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc_info) -> None:
        self.registry.current = self.previous


def get_rng_state(device="cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def get_rng_state_all() -> list:
    return [torch.default_generator.get_state()]


def set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    torch.default_generator.set_state(new_state)


def set_rng_state_all(new_states) -> None:
    for new_state in new_states:
        torch.default_generator.set_state(new_state)


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def zero_bytes(device=None) -> int:
    """`memory_allocated` / `max_memory_allocated` / `memory_reserved` / `max_memory_reserved`."""
    return 0


def memory_stats(device=None) -> dict:
    """No allocator, no statistics: torch returns the same empty dict before CUDA initializes."""
    return {}


def no_memory_to_manage(device=None) -> None:
    """`empty_cache` / `reset_peak_memory_stats`: there is no device cache or peak to reset."""


class NoopNvtx:
    """Replaces `torch.cuda.nvtx._nvtx`; NVTX ranges only annotate profiler timelines."""

    def __init__(self):
        self._depth = 0

    def rangePushA(self, msg) -> int:
        self._depth += 1
        return self._depth - 1

    def rangePop(self) -> int:
        self._depth -= 1
        return self._depth

    def rangeStartA(self, msg) -> int:
        return 0

    def rangeEnd(self, range_id) -> None:
        pass

    def markA(self, msg) -> None:
        pass

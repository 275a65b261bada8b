"""CUDA devices, through CuPy: the GPU side of the device interface (``device``).

A process's ``cuda:N`` devices all run on one GPU, the current one (device 0 as CUDA
sees it: ``CUDA_VISIBLE_DEVICES`` picks it), so several logical devices share it and the
whole suite's multi-device shapes run on a one-GPU machine (a warning says so). Plans
over several GPUs would need NCCL between them, which this version does not build.

Every plan stream of a cuda device, and every collective stream whose group is all cuda
devices, is a CUDA stream of its own (a collective stream of the highest priority, so
that its kernels start first as SMs free up); a kernel runs with it as CuPy's current
stream, so what the kernel does is queued there and the host goes on. A dependency
between streams is a CUDA event the producing stream records after the act and the
consuming stream waits on (``stream.wait_event``: the host never waits for another
stream); a host stream (``cpu:``) that reads what a GPU wrote, or writes a buffer a GPU
read, waits for the event on the host, as it must. The host also waits for the GPU at
the end of a run (``finish``), where it reads device memory (fetches, parameters), and
before it writes a pinned feed buffer again (``Staged``).

Registers are allocated once, on the GPU, as planned, and the allocation (queued on the
default stream) is waited for before any stream runs. Traced, a GPU kernel's span runs
from when its stream reached the act (after its waits) to the end of the act's last GPU
work: its time on the GPU where the GPU runs behind the host, the host's launch time
where the GPU waits for it. Feeds go to the GPU through pinned host buffers (``Staged``)
and fetches come back into pinned memory (``arrays.to_host_soon``), each copy queued on
the stream that runs it.
"""

from __future__ import annotations

import functools
import importlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import raw_kernel
from ..devices import is_cuda
from ..errors import DeviceError
from ..plan import Plan, Register, Stream
from ..text import size_text
from .device import CpuStream

EXTRA = "pip install 'actorflow[cuda]' (CuPy for CUDA 13; for CUDA 12: pip install cupy-cuda12x)"


HIGHEST_PRIORITY = -100
"""A CUDA stream priority past the highest any GPU has (lower is higher): clamped to it."""

SPIN = r"""
extern "C" __global__ void actorflow_spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}
"""
"""One thread spinning on the GPU's global timer for ``ns`` nanoseconds: it holds its
stream that long, and takes one slot of one SM."""


@functools.cache
def unavailable() -> str | None:
    """Why ``cuda:`` devices can't run here, or None when CuPy finds a GPU."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        return f"CuPy is not installed ({exc}): {EXTRA}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CuPy raises its own CUDA errors
        return f"CuPy finds no usable GPU ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CuPy finds no GPU"


def import_cupy() -> Any:
    """The cupy module, or a DeviceError saying why cuda devices can't run here."""
    why = unavailable()
    if why is not None:
        raise DeviceError(f"cuda: devices need CuPy and a GPU: {why}")
    return importlib.import_module("cupy")


def cuda_stream(stream: Stream) -> bool:
    """Whether ``stream`` runs on a GPU: a cuda device's, or a collective stream of a group
    of cuda devices (a group mixing host and GPU devices is refused by ``Gpus``)."""
    if stream.kind == "collective":
        return bool(stream.group) and all(is_cuda(d) for d in stream.group)
    return is_cuda(stream.device)


def fits_gpu(plan: Plan, devices: list[str], free: int, total: int) -> None:
    """A DeviceError unless the registers of ``devices`` (sharing one GPU) fit its ``free``
    memory: compiling checked each device against the host's memory (``max_memory``), not
    against the GPU it will run on."""
    planned = sum(plan.memory.get(d, 0) for d in devices)
    if planned > free:
        raise DeviceError(
            f"the plan's registers on {', '.join(devices)} take {size_text(planned)} ({planned} bytes); "
            f"the GPU has {size_text(free)} free of {size_text(total)}: lower the quotas or the batch, "
            "or compile with max_memory set to the GPU's"
        )


class Gpus:
    """This rank's GPU, as ``plan`` uses it: a CUDA stream per cuda plan stream
    (``streams``, by plan stream id), and the registers' memory."""

    @classmethod
    def of(cls, plan: Plan, rank: int) -> Gpus | None:
        """The GPU ``rank`` runs ``plan``'s cuda devices on, or None where it has none."""
        devices = sorted(
            {a.device for a in plan.actors if plan.rank_of(a.device) == rank and is_cuda(a.device)}
        )
        return cls(plan, rank, devices) if devices else None

    def __init__(self, plan: Plan, rank: int, devices: list[str]) -> None:
        self.cupy = cp = import_cupy()
        if plan.world > 1:
            raise DeviceError(
                "cuda: devices over several ranks need NCCL communicators between the ranks' GPUs, "
                "which this version does not build: run cuda plans in one process"
            )
        if len(devices) > 1:
            warnings.warn(
                f"{len(devices)} cuda devices share one GPU (this version runs a process's cuda devices "
                "on its current GPU)",
                RuntimeWarning,
                stacklevel=3,
            )
        fits_gpu(plan, devices, *cp.cuda.runtime.memGetInfo())
        for coll in plan.collectives:
            group = {plan.actors[a].device for a in coll.actors}
            if any(is_cuda(d) for d in group) and not all(is_cuda(d) for d in group):
                raise DeviceError(
                    f"collective {coll.name!r} mixes host and cuda devices ({sorted(group)}): "
                    "copy its tensors to one kind of device first (af.ops.to_device)"
                )
        # collectives first when SMs free up (as NCCL's streams are); CUDA clamps the
        # number to the highest priority the GPU has
        self.streams: dict[int, Any] = {
            s.id: cp.cuda.Stream(
                non_blocking=True, priority=HIGHEST_PRIORITY if s.kind == "collective" else 0
            )
            for s in plan.streams
            if s.rank == rank and cuda_stream(s)
        }
        self.timing: dict[int, tuple[Any, Any]] = {}
        """Traced (``prepare``): per plan stream, the timing events around its last kernel."""
        self._mark: tuple[Any, float] | None = None

    def synchronize(self) -> None:
        """Wait on the host for everything queued on the GPU: the registers' allocation and
        values (queued on the default stream, which the plan's streams don't wait for)."""
        self.cupy.cuda.Device().synchronize()

    def prepare(self, plan: Plan, units: list, traced: bool) -> None:
        """Before the first run: each unit on a GPU stream timed when ``traced`` (between
        two timing events, ``timing``), each feed staged (``Staged``), and the registers'
        allocation done."""
        for unit in units:
            if unit.stream not in self.streams:
                continue
            if traced:
                unit.kernel = functools.partial(self._timed, unit.kernel, unit.stream)
            if unit.feed is not None:
                unit.kernel = Staged(unit.kernel, self, plan.registers[unit.actor.outputs[0]])
        self.synchronize()

    def make_stream(self, stream: Stream) -> Callable[[Callable], CudaStream] | None:
        """What makes a driver's stream for plan stream ``stream`` (given its ``on_done``),
        or None for a host stream."""
        if stream.id not in self.streams:
            return None
        return functools.partial(CudaStream, stream.name, cuda=self.streams[stream.id], gpus=self)

    def _timed(self, kernel: Callable, stream: int, ins: list, outs: list) -> Any:
        cuda = self.streams[stream]
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record(cuda)
        result = kernel(ins, outs)
        end.record(cuda)
        self.timing[stream] = (start, end)
        return result

    def mark(self) -> None:
        """Before a traced run: a reference event, done at a known host time, from which
        ``time`` tells the host time of a timing event."""
        with self.cupy.cuda.Device(0):  # as on trio's thread, whichever thread starts the run
            event = self.cupy.cuda.Event()
            event.record(self.cupy.cuda.Stream.null)
            event.synchronize()
        self._mark = (event, time.perf_counter())

    def time(self, event: Any, host: float) -> GpuTime:
        """When the GPU reaches ``event``, recorded since ``mark``, on the host's clock
        (``host``, the host's own time of it, where the GPU's can't be read)."""
        assert self._mark is not None, "marked before the traced run"
        return GpuTime(*self._mark, event, self.cupy.cuda.get_elapsed_time, host)

    def link(self, kernel: Callable, seconds: float, ins: list, outs: list) -> Any:
        """A collective over an emulated link (``link_bandwidth``) on a GPU stream: the
        link's time is a spin on that stream (one thread, ``SPIN``), then the kernel, so the
        GPU's timeline has it where a host sleep (``wiring._lasting``) would not."""
        raw_kernel(SPIN, "actorflow_spin")((1,), (1,), (np.int64(round(seconds * 1e9)),))
        return kernel(ins, outs)

    def on_gpu(self, stream: int) -> bool:
        return stream in self.streams

    def event(self) -> Any:
        return self.cupy.cuda.Event(disable_timing=True)

    def zeros(self, register: Register) -> Any:
        return self.cupy.zeros(register.shape, register.dtype)

    def array(self, register: Register, value: np.ndarray) -> Any:
        return self.cupy.array(np.asarray(value, dtype=register.dtype))

    def use(self, stream: int) -> None:
        """Make plan stream ``stream``'s CUDA stream current for the calling thread (CuPy's
        current stream is per thread): the thread that replays it, once, so that every
        kernel it launches is queued there."""
        if stream in self.streams:
            self.streams[stream].use()

    def replayed(self, kernel: Callable, stream: int, waits: list, record: Any) -> Callable:
        """A replayed instruction's kernel on plan stream ``stream`` (whose CUDA stream its
        thread made current, ``use``): after the events ``waits`` (of the GPU streams it
        waits on), then recording ``record`` (where another stream waits on it). On a host
        stream the waits are the host's."""
        if not waits and record is None:
            return kernel
        cuda = self.streams.get(stream)
        if cuda is None:

            def on_host(ins: list, outs: list) -> Any:
                for event in waits:
                    event.synchronize()
                return kernel(ins, outs)

            return on_host

        def on_gpu(ins: list, outs: list) -> Any:
            for event in waits:
                cuda.wait_event(event)
            result = kernel(ins, outs)
            if record is not None:
                record.record(cuda)
            return result

        return on_gpu

    def finish(self, stream: int) -> None:
        """Wait on the host until plan stream ``stream``'s queued work is done (a CUDA
        error of that work is raised here)."""
        cuda = self.streams.get(stream)
        if cuda is not None:
            cuda.synchronize()


class GpuTime:
    """The host clock's time (``time.perf_counter``) when the GPU reached ``event``: a
    reference event ``mark``, done at host time ``at``, plus the GPU's time from it to
    ``event``. Read as a float only when a trace's spans are read (``Recorder.record``
    makes spans then), waiting for the event if it is not done: reading a thousand
    kernels' times at the end of each traced run held the host, with the GPU idle, for
    4 ms of each transformer step on an H200. After a CUDA error (a failed run's trace,
    read to see what ran), it is ``host``, the host's time of the act."""

    __slots__ = ("mark", "at", "event", "elapsed", "host")

    def __init__(
        self, mark: Any, at: float, event: Any, elapsed: Callable[[Any, Any], float], host: float
    ) -> None:
        self.mark, self.at, self.event, self.elapsed, self.host = mark, at, event, elapsed, host

    def __float__(self) -> float:
        try:
            self.event.synchronize()
            return self.at + self.elapsed(self.mark, self.event) / 1e3
        except RuntimeError:  # CuPy's CUDARuntimeError
            return self.host


class Staged:
    """A feed's kernel on a GPU stream: the host's value goes through pinned buffers (two,
    used in turn), so the copy to the GPU is queued on the stream and the host goes on; a
    buffer is written again once its last copy is done (its event)."""

    def __init__(self, kernel: Callable, gpus: Gpus, register: Register) -> None:
        cupyx = importlib.import_module("cupyx")
        self.kernel = kernel
        self._gpus = gpus
        self._pinned = [cupyx.empty_pinned(register.shape, register.dtype) for _ in range(2)]
        self._sent: list[Any] = [None, None]
        self._next = 0

    def __call__(self, ins: list, outs: list) -> Any:
        k = self._next
        self._next ^= 1
        if self._sent[k] is not None:
            self._sent[k].synchronize()
        np.copyto(self._pinned[k], ins[-1])
        ins[-1] = self._pinned[k]
        result = self.kernel(ins, outs)
        self._sent[k] = self._gpus.event()
        self._sent[k].record(self._gpus.cupy.cuda.get_current_stream())
        return result


class CudaStream(CpuStream):
    """A driver's stream (``device.Stream``) on a GPU: a launch queues the kernel on the
    CUDA stream and records an event after it (``event``); the end is reported when the
    launch returns, so successors are launched at once, waiting on that event on the GPU.
    Kernels that raise on the host are reported as failures, as ``CpuStream``'s are; a
    traced span's times are the CUDA events' (``Gpus.prepare``), not the host's."""

    def __init__(self, name: str, on_done: Callable, cuda: Any, gpus: Gpus) -> None:
        super().__init__(name, on_done, timed=False)
        self.cuda = cuda
        self._gpus = gpus

    def launch(self, kernel: Callable, ins: list, outs: list, ctx: Any) -> None:
        with self.cuda:
            super().launch(functools.partial(self._recorded, kernel), ins, outs, ctx)

    def _recorded(self, kernel: Callable, ins: list, outs: list) -> Any:
        result = kernel(ins, outs)
        self.event = self._gpus.event()
        self.event.record(self.cuda)
        return result

    def wait(self, event: Any) -> None:
        """Later launches wait on the GPU for ``event``."""
        self.cuda.wait_event(event)

    def finish(self) -> None:
        self.cuda.synchronize()

    def close(self) -> None:
        """Nothing to stop: what was queued on the GPU runs out on its own."""

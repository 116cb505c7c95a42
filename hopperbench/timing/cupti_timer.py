"""The CUPTI cold-L2 kernel-span timer: our implementation of FlashInfer's
`bench_gpu_time_with_cupti` protocol as of FlashInfer 0.6.9 (harness_facts.md §5.3-5.5).

There is no fallback: when CUPTI cannot trace, timing stops with `TimerUnavailable`
instead of silently switching to CUDA events, which would time different things.
"""

from __future__ import annotations

import gc
import importlib.metadata
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hopperbench.timing.span import ActivityTrace, ApiRecord, GpuRecord

MIN_CUPTI_MAJOR = 13
# FlashInfer asks CUPTI for 8 MiB activity buffers. A buffer that fills inside the timed loop is
# handed to our Python callback on CUPTI's thread, which holds the GIL while it copies the records
# out (a few us per record): the launching thread of a host-bound side then stalls inside some
# iteration's span. By estimate (~350 B of records per launch), 8 MiB fill after ~24k launches, and
# a trial of a Python reference comes close: the GDN reference at 134 tokens makes ~1k launches per
# call and ~14 calls per trial. 64 MiB keep such trials in one buffer, so that the copying happens
# at the flush after the loop. Trials with more records than that still pay it inside the loop.
_ACTIVITY_BUFFER_BYTES = 64 * 1024 * 1024
_API_KINDS = ("RUNTIME", "DRIVER")
_GPU_KINDS = ("CONCURRENT_KERNEL", "MEMCPY", "MEMSET")

PROTOCOL: dict[str, Any] = {
    "name": "cupti_cold_l2_kernel_span",
    "follows": "flashinfer>=0.6.9 bench_gpu_time_with_cupti (cold_l2_cache=True, use_cuda_graph=False)",
    "flush": "zero an int8 buffer before every warm-up and timed call",
    "flush_multiple_of_l2": 2,
    "sync_after_flush": True,
    "untimed_calls_before_warmup": 1,
    "activity_kinds": list(_API_KINDS + _GPU_KINDS),
    "activity_buffer_bytes": _ACTIVITY_BUFFER_BYTES,
    "span": "last end - first start of the GPU work whose API call started inside [t0, t1]",
    "aggregation": "median",
    # A collection of Python's cyclic garbage collector inside a timed window would add its pause
    # to the span of a host-bound side (a Python reference, a multi-launch library) in some
    # iterations and runs but not others; it runs before the timed loop instead. What survives it
    # is frozen (gc.freeze), so that the next trial's collection skips the ~400k objects of the
    # imported libraries (a full collection of them takes ~0.25 s on the H200 host).
    "python_gc": "collected and frozen before the timed iterations, disabled during them",
}


class TimerUnavailable(RuntimeError):
    """CUPTI activity tracing cannot run here (no cupti-python >= 13, no CUDA device or driver)."""


def cupti_python_version() -> str | None:
    """The installed cupti-python version, for the environment record; None if absent."""
    try:
        return importlib.metadata.version("cupti-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_cupti() -> Any:
    """The cupti module, after checking that cupti-python is importable and recent enough (TimerUnavailable if not)."""
    try:
        from cupti import cupti
    except ImportError as exc:
        raise TimerUnavailable(
            f"cupti-python is not importable ({exc}); install cupti-python>={MIN_CUPTI_MAJOR}"
        ) from None
    version = cupti_python_version()
    if version is None:
        raise TimerUnavailable("cupti imports but the cupti-python package metadata is missing; reinstall cupti-python")
    if int(version.split(".")[0]) < MIN_CUPTI_MAJOR:
        raise TimerUnavailable(f"cupti-python {version} is too old; the timer needs major version >= {MIN_CUPTI_MAJOR}")
    return cupti


def _resolve_device(device: torch.device | str | int | None, args: Sequence[Any]) -> torch.device:
    if not torch.cuda.is_available():
        raise TimerUnavailable("no CUDA device is available; the CUPTI timer needs one")
    if device is None:
        # As FlashInfer: the device of the first CUDA tensor among the arguments.
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), "cuda")
    resolved = torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"the CUPTI timer needs a CUDA device, got {resolved}")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def flush_buffer_bytes(device: torch.device) -> int:
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    if l2_bytes <= 0:
        raise TimerUnavailable(f"{device} reports no L2 cache size; cannot size the flush buffer")
    return PROTOCOL["flush_multiple_of_l2"] * l2_bytes


class _RecordCollector:
    """Copies CUPTI activity records into our plain records as buffers complete.

    The activity objects point into CUPTI-owned buffers, so nothing of them is kept.
    """

    def __init__(self, cupti: Any) -> None:
        kind = cupti.ActivityKind
        self._api_kinds = {int(getattr(kind, k)) for k in _API_KINDS}
        self._kernel = int(kind.CONCURRENT_KERNEL)
        self._memcpy = int(kind.MEMCPY)
        self._memset = int(kind.MEMSET)
        self.api_records: list[ApiRecord] = []
        self.gpu_records: list[GpuRecord] = []

    def buffer_requested(self) -> tuple[int, int]:
        return _ACTIVITY_BUFFER_BYTES, 0

    def buffer_completed(self, activities: list[Any]) -> None:
        for activity in activities:
            kind = int(activity.kind)
            if kind in self._api_kinds:
                self.api_records.append(
                    ApiRecord(
                        start=activity.start,
                        end=activity.end,
                        correlation_id=activity.correlation_id,
                        kind=kind,
                        callback_id=activity.cbid,
                    )
                )
            elif kind == self._kernel:
                self.gpu_records.append(self._gpu(activity, name=activity.name))
            elif kind == self._memcpy:
                self.gpu_records.append(
                    self._gpu(activity, name="MEMCPY", copy_kind=activity.copy_kind, nbytes=activity.bytes)
                )
            elif kind == self._memset:
                self.gpu_records.append(
                    self._gpu(activity, name="MEMSET", nbytes=activity.bytes, value=activity.value)
                )

    @staticmethod
    def _gpu(activity: Any, *, name: str, copy_kind: int = 0, nbytes: int = 0, value: int = 0) -> GpuRecord:
        return GpuRecord(
            name=name,
            start=activity.start,
            end=activity.end,
            correlation_id=activity.correlation_id,
            kind=int(activity.kind),
            copy_kind=int(copy_kind),
            bytes=int(nbytes),
            value=int(value),
        )


def _activity_kinds(cupti: Any) -> list[Any]:
    return [getattr(cupti.ActivityKind, k) for k in _API_KINDS + _GPU_KINDS]


def _start_tracing(cupti: Any, collector: _RecordCollector) -> None:
    enabled = []
    try:
        for kind in _activity_kinds(cupti):
            cupti.activity_enable(kind)
            enabled.append(kind)
        cupti.activity_register_callbacks(collector.buffer_requested, collector.buffer_completed)
    except Exception as exc:  # cuptiError and the binding's NotSupportedError share no base
        for kind in enabled:
            cupti.activity_disable(kind)
        raise TimerUnavailable(f"CUPTI activity tracing could not start: {exc}") from exc


def _stop_tracing(cupti: Any) -> None:
    try:
        # Forced: deliver every buffer, including the partly filled last one.
        cupti.activity_flush_all(int(cupti.ActivityFlag.FLUSH_FORCED))
        for kind in _activity_kinds(cupti):
            cupti.activity_disable(kind)
    finally:
        cupti.finalize()


def budgeted_counts(first_call_s: float, warmup: int, iterations: int, time_budget_s: float | None) -> tuple[int, int]:
    """(warmup, iterations) for a call that took `first_call_s` untimed, when the warm-up and timed
    calls of one trial should take about `time_budget_s`: as many timed calls as fit (at least 1,
    at most `iterations`), then warm-up calls with what is left (at most `warmup`). No budget, or a
    call fast enough for all of them: the counts as given."""
    if time_budget_s is None:
        return warmup, iterations
    if time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be positive, got {time_budget_s}")
    fits = math.floor(time_budget_s / max(first_call_s, 1e-9))
    timed = min(iterations, max(1, fits))
    return min(warmup, max(0, fits - timed)), timed


def record_cold_l2(
    fn: Callable[..., Any],
    args: Sequence[Any],
    warmup: int,
    iterations: int,
    device: torch.device | str | int | None = None,
    time_budget_s: float | None = None,
) -> ActivityTrace:
    """Run the cold-L2 protocol (see `time_cold_l2`) and return the raw activity trace."""
    if warmup < 0 or iterations < 1:
        raise ValueError(f"need warmup >= 0 and iterations >= 1, got warmup={warmup}, iterations={iterations}")
    cupti = load_cupti()
    dev = _resolve_device(device, args)
    try:
        cupti.get_timestamp()  # fails fast when CUPTI cannot reach the driver
    except Exception as exc:
        raise TimerUnavailable(f"CUPTI cannot read its clock: {exc}") from exc
    with torch.cuda.device(dev):
        flush_buffer = torch.empty(flush_buffer_bytes(dev), dtype=torch.int8, device=dev)

        torch.cuda.synchronize(dev)
        started = time.perf_counter()
        fn(*args)  # a lazy compile or autotune lands here, untimed
        torch.cuda.synchronize(dev)
        warmup, iterations = budgeted_counts(time.perf_counter() - started, warmup, iterations, time_budget_s)
        for _ in range(warmup):
            flush_buffer.zero_()
            fn(*args)
        torch.cuda.synchronize(dev)

        collector = _RecordCollector(cupti)
        trace = ActivityTrace()
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        _start_tracing(cupti, collector)
        try:
            for _ in range(iterations):
                flush_buffer.zero_()
                # Start from an idle GPU so the call pays its own launch gaps (FlashInfer >= 0.6.9).
                torch.cuda.synchronize(dev)
                t0 = cupti.get_timestamp()
                fn(*args)
                t1 = cupti.get_timestamp()
                torch.cuda.synchronize(dev)
                trace.windows.append((t0, t1))
        finally:
            if gc_was_enabled:
                gc.enable()
            _stop_tracing(cupti)
    trace.api_records = collector.api_records
    trace.gpu_records = collector.gpu_records
    return trace


def time_cold_l2(
    fn: Callable[..., Any],
    args: Sequence[Any],
    warmup: int,
    iterations: int,
    device: torch.device | str | int | None = None,
    time_budget_s: float | None = None,
) -> list[float]:
    """Per-iteration kernel span in ms of `fn(*args)` with a cold L2, measured with CUPTI.

    Protocol (FlashInfer >= 0.6.9 `bench_gpu_time_with_cupti`, cold L2, no CUDA graph):
    1. flush buffer: int8, 2 x the device's L2 size, allocated once; a flush zeroes it;
    2. one untimed call, then synchronize; with `time_budget_s`, its wall time caps the counts
       (`budgeted_counts`: at least one timed call, at most `iterations`);
    3. `warmup` x {flush; call}, then synchronize;
    4. enable CUPTI activity kinds RUNTIME, DRIVER, CONCURRENT_KERNEL, MEMCPY, MEMSET;
    5. collect Python's garbage, freeze what survives and disable the collector; `iterations` x {flush; synchronize;
       t0 = CUPTI timestamp; call; t1 = CUPTI timestamp; synchronize}; re-enable it;
    6. flush the activity buffers, disable the kinds, finalize CUPTI;
    7. per iteration, the span from the first start to the last end of the GPU work
       (kernels, memcpys, memsets) whose API call started inside [t0, t1]
       (`span.iteration_spans`): host gaps between the call's launches count, the
       flush does not.
    The caller aggregates with the median (`PROTOCOL["aggregation"]`). Unlike FlashInfer
    there are no five extra estimate calls, and no CUDA-event fallback: without
    cupti-python >= 13 or a CUDA device this raises `TimerUnavailable`. A call that
    launches no GPU work, or different work from one iteration to the next, raises
    `span.TimingError`. Arguments are reused unchanged in every call (no clones).
    """
    return record_cold_l2(fn, args, warmup, iterations, device, time_budget_s).spans()


def empty_kernel_span_ms(
    warmup: int = 10, iterations: int = 50, device: torch.device | str | int | None = None
) -> float:
    """Median span of a one-element in-place add under the same protocol: the latency floor."""
    dev = _resolve_device(device, ())
    scratch = torch.zeros(1, dtype=torch.float32, device=dev)
    spans = time_cold_l2(torch.Tensor.add_, (scratch, 1.0), warmup, iterations, dev)
    return statistics.median(spans)

"""Kernel timing: the CUPTI cold-L2 span timer and its pure record-correlation logic."""

from hopperbench.timing.cupti_timer import (
    PROTOCOL,
    TimerUnavailable,
    empty_kernel_span_ms,
    record_cold_l2,
    time_cold_l2,
)
from hopperbench.timing.span import (
    ActivityTrace,
    ApiRecord,
    GpuRecord,
    SpanSummary,
    TimingError,
    iteration_busy,
    iteration_spans,
    summarize_spans,
)

__all__ = [
    "PROTOCOL",
    "ActivityTrace",
    "ApiRecord",
    "GpuRecord",
    "SpanSummary",
    "TimerUnavailable",
    "TimingError",
    "empty_kernel_span_ms",
    "iteration_busy",
    "iteration_spans",
    "record_cold_l2",
    "summarize_spans",
    "time_cold_l2",
]

"""Kernel timing: the CUPTI cold-L2 span timer and its pure record-correlation logic."""

from hopperbench.timing.cupti_timer import PROTOCOL, TimerUnavailable, empty_kernel_span_ms, time_cold_l2
from hopperbench.timing.span import (
    ActivityTrace,
    ApiRecord,
    GpuRecord,
    SpanSummary,
    TimingError,
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
    "iteration_spans",
    "summarize_spans",
    "time_cold_l2",
]

"""CUPTI record correlation and span logic, driven by recorded activity fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hopperbench.timing.span import (
    ActivityTrace,
    ApiRecord,
    GpuRecord,
    TimingError,
    iteration_busy,
    iteration_gpu_records,
    iteration_spans,
    summarize_spans,
)

DATA = Path(__file__).parent / "data"
RUNTIME, DRIVER, MEMCPY, MEMSET, KERNEL = 5, 4, 1, 2, 10


def load_fixture(name: str) -> tuple[ActivityTrace, dict]:
    raw = json.loads((DATA / f"cupti_records_{name}.json").read_text())
    return ActivityTrace.from_json(raw), raw["expected"]


def test_consistent_trace_gives_the_designed_spans():
    trace, expected = load_fixture("consistent")
    spans = iteration_spans(trace.windows, trace.api_records, trace.gpu_records)
    assert spans == pytest.approx(expected["spans_ms"], rel=0, abs=1e-12)
    assert trace.spans() == spans


def test_each_iteration_owns_exactly_its_launches():
    trace, expected = load_fixture("consistent")
    per_iteration = iteration_gpu_records(trace.windows, trace.api_records, trace.gpu_records)
    assert len(per_iteration) == len(trace.windows)
    flush_ids = {g.correlation_id for g in trace.gpu_records if "FillFunctor" in g.name}
    for records, (t0, _t1) in zip(per_iteration, trace.windows):
        assert len(records) == expected["signatures_per_iteration"]
        # The flush is excluded even where it runs on the GPU after t0 (odd iterations).
        assert not {g.correlation_id for g in records} & flush_ids
        assert {g.kind for g in records} == {MEMSET, MEMCPY, KERNEL}
        # The kernel launched through the driver API (cuLaunchKernelEx) is counted.
        assert any(g.name.startswith("kernel_cutlass_") for g in records)
        assert all(g.start >= t0 for g in records)
    flushes = [g for g in trace.gpu_records if g.correlation_id in flush_ids]
    assert any(g.start < t0 < g.end for g in flushes for t0, _ in trace.windows), "fixture lacks an overlapping flush"


def test_span_covers_host_gaps_between_first_and_last_gpu_record():
    trace, _ = load_fixture("consistent")
    per_iteration = iteration_gpu_records(trace.windows, trace.api_records, trace.gpu_records)
    spans = trace.spans()
    for records, span in zip(per_iteration, spans):
        busy_ns = sum(g.end - g.start for g in records)
        assert span * 1e6 > busy_ns  # the idle gaps between records are part of the span


def test_busy_time_counts_overlaps_once_and_leaves_out_gaps_and_the_flush():
    api = [ApiRecord(start=t, end=t + 1, correlation_id=c, kind=RUNTIME, callback_id=211)
           for t, c in ((5, 9), (100, 1), (110, 2), (120, 3))]  # fmt: skip
    gpu = [
        GpuRecord(name="flush", start=500, end=1_200, correlation_id=9, kind=KERNEL),  # launched before t0
        GpuRecord(name="a", start=1_000, end=2_000, correlation_id=1, kind=KERNEL),
        GpuRecord(name="b", start=1_500, end=2_500, correlation_id=2, kind=KERNEL),  # overlaps a
        GpuRecord(name="c", start=6_000, end=6_500, correlation_id=3, kind=KERNEL),  # after a host gap
    ]
    assert iteration_spans([(100, 130)], api, gpu) == [pytest.approx(5_500 / 1e6)]
    assert iteration_busy([(100, 130)], api, gpu) == [pytest.approx(2_000 / 1e6)]
    # Nested and touching records.
    nested = [GpuRecord(name="outer", start=0, end=1_000, correlation_id=1, kind=KERNEL),
              GpuRecord(name="inner", start=200, end=300, correlation_id=2, kind=KERNEL),
              GpuRecord(name="next", start=1_000, end=1_100, correlation_id=3, kind=KERNEL)]  # fmt: skip
    assert iteration_busy([(100, 130)], api, nested) == [pytest.approx(1_100 / 1e6)]


def test_busy_time_of_a_recorded_trace_is_within_its_spans():
    trace, _ = load_fixture("consistent")
    for busy, span in zip(trace.busy(), trace.spans(), strict=True):
        assert 0 < busy < span


def test_record_order_does_not_matter():
    trace, _ = load_fixture("consistent")
    reversed_spans = iteration_spans(trace.windows, trace.api_records[::-1], trace.gpu_records[::-1])
    assert reversed_spans == trace.spans()


def test_empty_iteration_raises_and_names_it():
    trace, expected = load_fixture("empty_iteration")
    with pytest.raises(TimingError, match=rf"^iteration {expected['error_iteration']} launched no GPU work$"):
        trace.spans()


def test_mismatched_iteration_raises_and_names_the_difference():
    trace, expected = load_fixture("mismatch")
    with pytest.raises(TimingError) as info:
        trace.spans()
    message = str(info.value)
    assert message.startswith(f"iteration {expected['error_iteration']} launched different GPU work")
    assert f"missing ['{expected['missing']}_0_0_0_{KERNEL}']" in message
    assert f"extra ['{expected['extra']}_0_0_0_{KERNEL}']" in message
    assert "\n" not in message


def test_window_bounds_are_inclusive():
    api = [
        ApiRecord(start=100, end=110, correlation_id=1, kind=RUNTIME, callback_id=211),
        ApiRecord(start=200, end=210, correlation_id=2, kind=RUNTIME, callback_id=211),
        ApiRecord(start=201, end=210, correlation_id=3, kind=RUNTIME, callback_id=211),
    ]
    gpu = [
        GpuRecord(name="k", start=1_000, end=1_500, correlation_id=1, kind=KERNEL),
        GpuRecord(name="k2", start=1_600, end=3_000, correlation_id=2, kind=KERNEL),
        GpuRecord(name="late", start=4_000, end=9_000, correlation_id=3, kind=KERNEL),
    ]
    assert iteration_spans([(100, 200)], api, gpu) == [pytest.approx(2_000 / 1e6)]


def test_memset_value_and_memcpy_bytes_are_part_of_the_signature():
    api = [ApiRecord(start=t, end=t + 1, correlation_id=t, kind=RUNTIME, callback_id=51) for t in (10, 20)]
    gpu = [
        GpuRecord(name="MEMSET", start=100, end=200, correlation_id=10, kind=MEMSET, bytes=64, value=0),
        GpuRecord(name="MEMSET", start=300, end=400, correlation_id=20, kind=MEMSET, bytes=64, value=255),
    ]
    with pytest.raises(TimingError, match="iteration 1 launched different GPU work"):
        iteration_spans([(10, 10), (20, 20)], api, gpu)


def test_backwards_window_is_rejected():
    with pytest.raises(TimingError, match="ends before it starts"):
        iteration_spans([(5, 4)], [], [])


def test_trace_round_trips_through_json():
    trace, _ = load_fixture("consistent")
    again = ActivityTrace.from_json(json.loads(json.dumps(trace.to_json())))
    assert again == trace


def test_summarize_spans():
    summary = summarize_spans([3.0, 1.0, 2.0, 10.0])
    assert (summary.median_ms, summary.min_ms, summary.max_ms, summary.count) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(TimingError):
        summarize_spans([])


def test_spans_and_busy_share_one_attribution_until_the_trace_grows():
    trace, expected = load_fixture("consistent")
    first = trace.per_iteration()
    assert trace.per_iteration() is first
    assert trace.spans() == pytest.approx(expected["spans_ms"], rel=0, abs=1e-12)
    assert trace.busy() == iteration_busy(trace.windows, trace.api_records, trace.gpu_records)
    trace.windows.pop()  # a changed trace is attributed again
    assert len(trace.per_iteration()) == len(trace.windows)
    assert len(trace.spans()) == len(trace.windows)

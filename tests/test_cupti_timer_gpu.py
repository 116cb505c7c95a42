"""The CUPTI cold-L2 timer. GPU tests need CUDA; the availability checks run anywhere.

Set HOPPERBENCH_TRACE_DIR to keep the activity trace of a real run as JSON (a fixture
for tests/test_span.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from hopperbench.timing import cupti_timer
from hopperbench.timing.cupti_timer import (
    PROTOCOL,
    TimerUnavailable,
    empty_kernel_span_ms,
    record_cold_l2,
    time_cold_l2,
)
from hopperbench.timing.span import TimingError, iteration_gpu_records

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_protocol_record_names_the_choices():
    assert PROTOCOL["flush_multiple_of_l2"] == 2
    assert PROTOCOL["sync_after_flush"] is True
    assert PROTOCOL["aggregation"] == "median"
    json.dumps(PROTOCOL)  # goes into the environment record as is


@pytest.mark.parametrize(
    "first_call_s, budget, expected",
    [
        (1e-5, 0.5, (3, 50)),  # a kernel: the counts as given
        (0.002, 0.5, (3, 50)),  # 250 calls fit
        (0.02, 0.5, (0, 25)),  # 25 fit: all timed, no warm-up
        (0.009, 0.5, (3, 50)),  # 55 fit: 50 timed, 3 warm-up (of the 5 left)
        (0.0095, 0.5, (2, 50)),  # 52 fit: 50 timed, 2 warm-up
        (0.3, 0.5, (0, 1)),  # one fits
        (2.0, 0.5, (0, 1)),  # none fits: still one timed call
        (2.0, None, (3, 50)),  # no budget
    ],
)
def test_budgeted_counts(first_call_s, budget, expected):
    assert cupti_timer.budgeted_counts(first_call_s, 3, 50, budget) == expected


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="time_budget_s"):
        cupti_timer.budgeted_counts(0.1, 3, 50, 0.0)


@needs_cuda
def test_a_slow_call_gets_fewer_timed_iterations_under_a_budget():
    scratch = torch.zeros(1, device="cuda")

    def slow(x):
        time.sleep(0.05)  # host time: the span sees one small kernel
        x.add_(1.0)

    spans = time_cold_l2(slow, (scratch,), warmup=3, iterations=50, time_budget_s=0.2)
    assert 1 <= len(spans) <= 4
    assert len(time_cold_l2(torch.Tensor.add_, (scratch, 1.0), 3, 50, time_budget_s=0.2)) == 50


def test_missing_cupti_python_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # makes `from cupti import cupti` raise ImportError
    with pytest.raises(TimerUnavailable, match="cupti-python is not importable"):
        time_cold_l2(lambda: None, (), warmup=0, iterations=1)


def test_old_cupti_python_is_refused(monkeypatch):
    monkeypatch.setattr(cupti_timer.importlib.metadata, "version", lambda name: "12.8.0")
    with pytest.raises(TimerUnavailable, match="12.8.0 is too old"):
        time_cold_l2(lambda: None, (), warmup=0, iterations=1)


def test_no_cuda_device_is_reported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TimerUnavailable, match="no CUDA device"):
        time_cold_l2(lambda: None, (), warmup=0, iterations=1)


def test_bad_iteration_counts_are_rejected():
    with pytest.raises(ValueError, match="iterations >= 1"):
        time_cold_l2(lambda: None, (), warmup=0, iterations=0)


def _matmul_operands(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    return a, b, torch.empty(n, n, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_matmul_spans_are_positive_and_plausible():
    floor = empty_kernel_span_ms(warmup=5, iterations=20)
    assert 0 < floor < 0.5
    a_small, b_small, _ = _matmul_operands(2048)
    small = time_cold_l2(torch.mm, (a_small, b_small), warmup=5, iterations=20)  # value-returning
    a, b, out = _matmul_operands(4096)
    large = time_cold_l2(lambda x, y, o: torch.mm(x, y, out=o), (a, b, out), warmup=5, iterations=20)
    assert len(small) == 20 and len(large) == 20
    assert all(s > floor / 2 for s in small)
    # 8x the FLOPs: clearly longer, and no slower than a very pessimistic 50 TFLOP/s.
    assert statistics.median(large) > 3 * statistics.median(small)
    assert statistics.median(large) < 2 * 4096**3 / 50e12 * 1e3


@pytest.mark.gpu
@needs_cuda
def test_real_records_carry_copies_and_kernels():
    a, b, out = _matmul_operands(1024)
    host = torch.arange(64, dtype=torch.int32).pin_memory()
    device_copy = torch.empty(64, dtype=torch.int32, device="cuda")

    def step() -> None:
        device_copy.copy_(host, non_blocking=True)
        torch.mm(a, b, out=out)

    trace = record_cold_l2(step, (), warmup=3, iterations=5)
    per_iteration = iteration_gpu_records(trace.windows, trace.api_records, trace.gpu_records)
    assert len(per_iteration) == 5
    for records in per_iteration:
        copies = [r for r in records if r.name == "MEMCPY"]
        assert len(copies) == 1 and copies[0].bytes == host.numel() * 4 and copies[0].copy_kind == 1  # HtoD
        assert any(r.name not in ("MEMCPY", "MEMSET") for r in records)
    assert all(s > 0 for s in trace.spans())
    if directory := os.environ.get("HOPPERBENCH_TRACE_DIR"):
        path = Path(directory) / "cupti_records_recorded_copy_and_mm.json"
        doc = {"description": f"recorded on {torch.cuda.get_device_name()}", **trace.to_json()}
        path.write_text(json.dumps(doc))


@pytest.mark.gpu
@needs_cuda
def test_call_that_launches_nothing_raises():
    with pytest.raises(TimingError, match="iteration 0 launched no GPU work"):
        time_cold_l2(lambda: None, (), warmup=1, iterations=3)


@pytest.mark.gpu
@needs_cuda
def test_kernel_set_changing_between_iterations_raises():
    x = torch.zeros(1024, device="cuda")
    calls = {"n": 0}

    def alternating() -> None:
        calls["n"] += 1
        x.add_(1.0)
        if calls["n"] % 2:
            x.mul_(0.5)

    with pytest.raises(TimingError, match="iteration 1 launched different GPU work"):
        time_cold_l2(alternating, (), warmup=2, iterations=4)


@pytest.mark.gpu
@needs_cuda
def test_host_gap_between_kernels_counts():
    x = torch.zeros(1, device="cuda")

    def two_kernels_with_a_host_gap() -> None:
        x.add_(1.0)
        time.sleep(0.002)
        x.add_(1.0)

    trace = record_cold_l2(two_kernels_with_a_host_gap, (), warmup=2, iterations=5)
    spans, busy = trace.spans(), trace.busy()
    assert min(spans) >= 2.0
    assert statistics.median(spans) < 20.0
    # The GPU was busy only for the two tiny kernels, not the 2 ms sleep between them.
    assert all(0 < b < 0.1 for b in busy)


@pytest.mark.gpu
@needs_cuda
def test_cupti_python_is_the_pinned_major():
    assert int(importlib.metadata.version("cupti-python").split(".")[0]) >= cupti_timer.MIN_CUPTI_MAJOR


@needs_cuda
def test_garbage_collector_is_off_only_inside_the_timed_iterations():
    import gc

    seen: list[bool] = []
    scratch = torch.zeros(1, device="cuda")

    def call(x):
        seen.append(gc.isenabled())
        x.add_(1.0)

    assert gc.isenabled()
    time_cold_l2(call, (scratch,), warmup=2, iterations=5)
    # untimed call and warm-up with the collector on, the 5 timed calls with it off, then on again
    assert seen == [True] * 3 + [False] * 5
    assert gc.isenabled()


# ------------------------------------------------------------------------------------------
# Graph replays (hopperbench.timing.graph)


@pytest.mark.gpu
@needs_cuda
def test_a_captured_call_replays_and_its_replays_are_timed() -> None:
    from hopperbench.timing.graph import capture_call

    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)

    def call(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.mul(a, 2.0, out=b)
        b.add_(1.0)

    replay, _ = capture_call(call, [x, out])
    out.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2.0 + 1.0)
    trace = record_cold_l2(replay, [], warmup=2, iterations=10)
    spans, busy = trace.spans(), trace.busy()
    # Both kernels of the graph belong to the replay's launch: the span covers them.
    assert len(spans) == 10 and all(s > 0 for s in spans)
    assert all(len(records) == 2 for records in iteration_gpu_records(trace.windows, trace.api_records, trace.gpu_records))
    assert all(b <= s + 1e-9 for b, s in zip(busy, spans))


@pytest.mark.gpu
@needs_cuda
def test_a_call_that_reads_device_data_on_the_host_is_not_capturable() -> None:
    from hopperbench.timing.graph import NotCapturable, capture_call

    x = torch.randn(16, device="cuda")

    def syncs(a: torch.Tensor) -> float:
        return float(a.sum().item())

    with pytest.raises(NotCapturable):
        capture_call(syncs, [x])
    # The context stays usable after the failed capture.
    assert float((x * 0).sum().item()) == 0.0

"""tools/kernel_breakdown.py: the per-activity breakdown of recorded iterations, and its CLI errors."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from hopperbench.timing.span import ApiRecord, GpuRecord

tool = load_module_by_path(REPO_ROOT / "tools/kernel_breakdown.py", "kernel_breakdown_tool")


def rec(name: str, start_us: float, end_us: float, cid: int = 1) -> GpuRecord:
    return GpuRecord(name=name, start=int(start_us * 1000), end=int(end_us * 1000), correlation_id=cid, kind=0)


def test_medians_by_position_with_the_gaps_between_activities():
    iterations = [
        # routing 2 us, host gap 10 us, gemm 30 us; listed out of order on purpose
        [rec("gemm", 112, 142), rec("routing", 100, 102)],
        [rec("routing", 500, 503), rec("gemm", 515, 545)],  # 3 us, gap 12, 30 us
        [rec("routing", 900, 902), rec("gemm", 908, 940)],  # 2 us, gap 6, 32 us
    ]
    result = tool.breakdown(iterations)
    assert [(a.position, a.name) for a in result.activities] == [(0, "routing"), (1, "gemm")]
    assert result.activities[0].median_us == pytest.approx(2.0)
    assert result.activities[0].median_gap_before_us == 0.0
    assert result.activities[1].median_us == pytest.approx(30.0)
    assert result.activities[1].median_gap_before_us == pytest.approx(10.0)
    assert result.median_span_us == pytest.approx(42.0)  # spans 42, 45, 40
    text = tool.render("moe #1:", result)
    assert "routing" in text and "42.0" in text and "gaps/overlap 10.0" in text


def test_overlapping_activities_count_no_negative_gap():
    result = tool.breakdown([[rec("a", 0, 10), rec("b", 5, 12)]])
    assert result.activities[1].median_gap_before_us == 0.0
    assert result.median_span_us == pytest.approx(12.0)


def test_a_different_order_in_one_iteration_is_refused():
    with pytest.raises(tool.BreakdownError, match="iteration 1"):
        tool.breakdown([[rec("a", 0, 1), rec("b", 2, 3)], [rec("b", 10, 11), rec("a", 12, 13)]])
    with pytest.raises(tool.BreakdownError, match="no iterations"):
        tool.breakdown([])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--track", "nope"], "nope"),
        (["--track", "moe", "--workloads", "x"], "comma-separated"),
        (["--track", "moe", "--workloads", "-1"], ">= 0"),
        (["--track", "moe", "--workloads", "99"], "out of range"),
        (["--track", "moe", "--side", "nobody"], "nobody"),
        (["--track", "dsa_attention", "--workload-list", "offlist"], "has no off-list workloads"),
        (["--track", "gdn_prefill", "--workload-list", "offlist", "--workloads", "4"], "has 4 workloads"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    assert tool.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_says_so(capsys):
    assert tool.main(["--track", "dsa_attention"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_timeline_says_when_each_activity_was_issued_started_and_ended():
    api = tool.ApiRecord
    # Two iterations of routing then gemm (correlation ids 1, 2 and 3, 4); the gemm's launch is issued after
    # the routing ended, so the gemm waited for the host, not for the GPU.
    iterations = [
        [rec("routing", 100, 106, cid=1), rec("gemm", 110, 140, cid=2)],
        [rec("routing", 500, 507, cid=3), rec("gemm", 512, 540, cid=4)],
    ]
    launches = [
        api(start=98_000, end=99_000, correlation_id=1, kind=0, callback_id=0),
        api(start=107_000, end=108_000, correlation_id=2, kind=0, callback_id=0),
        # a runtime call and the driver call inside it share an id: the earlier start counts
        api(start=107_500, end=107_900, correlation_id=2, kind=1, callback_id=0),
        api(start=497_000, end=498_000, correlation_id=3, kind=0, callback_id=0),
        api(start=509_000, end=510_000, correlation_id=4, kind=0, callback_id=0),
    ]
    issued = tool.issue_times(launches)
    assert issued[2] == 107_000
    result = tool.breakdown(iterations, issued)
    routing, gemm = result.activities
    assert routing.median_start_us == 0.0 and routing.median_end_us == pytest.approx(6.5)
    assert routing.median_issued_us == pytest.approx(-2.5)  # issued 2 and 3 us before it started
    assert gemm.median_start_us == pytest.approx(11.0) and gemm.median_end_us == pytest.approx(40.0)
    assert gemm.median_issued_us == pytest.approx(8.0)  # 7 and 9 us after the routing started
    assert gemm.median_issued_us > routing.median_end_us
    text = tool.render("moe #1:", result)
    assert "issued" in text and "8.0" in text
    # Without the launches the column says unknown.
    assert tool.breakdown(iterations).activities[1].median_issued_us is None
    assert tool.breakdown(iterations, {1: 98_000}).activities[1].median_issued_us is None


def api(start_us: float, end_us: float, cbid: int, kind: int = 5) -> ApiRecord:
    start, end = int(start_us * 1000), int(end_us * 1000)
    return ApiRecord(start=start, end=end, correlation_id=cbid, kind=kind, callback_id=cbid)


def test_host_calls_inside_each_window_lined_up_on_the_gpu_origin():
    # Two iterations, each two launches (cbid 7 then 9); a call outside the windows is ignored.
    windows = [(0, 20_000), (100_000, 130_000)]
    records = [api(1, 3, 7), api(6, 7, 9), api(50, 51, 4), api(102, 105, 7), api(109, 110, 9)]
    origins = [9_000, 111_000]  # first GPU start of each iteration, ns
    calls = tool.host_calls(windows, records, origins, lambda r: f"cb{r.callback_id}")
    assert [(c.position, c.name) for c in calls] == [(0, "cb7"), (1, "cb9")]
    assert calls[0].median_start_us == pytest.approx(-8.5)  # -8 and -9
    assert calls[0].median_us == pytest.approx(2.5)  # 2 and 3
    assert calls[1].median_start_us == pytest.approx(-2.5)  # -3 and -2
    text = tool.render_host_calls(calls)
    assert "cb7" in text and "-8.5" in text


def test_host_calls_that_differ_between_iterations_are_not_lined_up():
    windows = [(0, 20_000), (100_000, 130_000)]
    records = [api(1, 3, 7), api(102, 105, 9)]
    assert tool.host_calls(windows, records, [0, 100_000], str) is None
    assert "not the same calls" in tool.render_host_calls(None)
    with pytest.raises(tool.BreakdownError, match="origins"):
        tool.host_calls(windows, records, [0], str)


def test_api_calls_are_named_from_cuptis_tables():
    cupti = pytest.importorskip("cupti.cupti")
    name_of = tool.api_call_namer(cupti)
    launch = int(cupti.driver_api_trace_cbid.cuLaunchKernelEx)
    assert name_of(ApiRecord(0, 1, 1, int(cupti.ActivityKind.DRIVER), launch)) == "cuLaunchKernelEx"
    assert name_of(ApiRecord(0, 1, 1, 99, 3)) == "kind 99: 3"


def test_a_side_with_a_prepare_step_is_timed_on_what_it_returns():
    # as the runner's worker does: prepare's values (by name, in order), then the outputs
    def prepare(a, b):
        return {"a": a * 2, "b": b}

    assert tool.timed_arguments({"a": 1, "b": 3}, prepare, ["out"]) == [2, 3, "out"]
    assert tool.timed_arguments({"a": 1, "b": 3}, None, []) == [1, 3]

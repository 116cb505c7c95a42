"""Capturing one call of a side in a CUDA graph, so that its replays can be timed.

A replay launches the captured kernels with no Python in between: its span holds the GPU work
and the launch of one graph, not the host gaps between a side's launches. A side whose call
synchronises with the host, or reads device data on the host, cannot be captured; that is
reported (`NotCapturable`), never replaced by eager timing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class NotCapturable(RuntimeError):
    """The call cannot be recorded in a CUDA graph (a host sync, a host read of device data, ...)."""


def _first_line(exc: BaseException) -> str:
    text = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def capture_call(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Callable[[], None], Any]:
    """(replay, result): a CUDA graph of `fn(*args)` and the value the captured call returned.

    As PyTorch recommends, the call runs once on a side stream before the capture, so that lazy
    initialisation (workspace allocation, autotuning, module loads) happens outside it. The
    graph's tensors, the returned ones included, live at fixed addresses: each replay rewrites
    them. Raises NotCapturable with the first line of the error when the capture fails."""
    device = torch.device("cuda", torch.cuda.current_device())
    side_stream = torch.cuda.Stream(device)
    side_stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side_stream):
            fn(*args)
        torch.cuda.current_stream(device).wait_stream(side_stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = fn(*args)
    except Exception as e:  # the capture's error, or the one the capture's end raises after it
        cause: BaseException = e
        while cause.__context__ is not None:  # the capture's end raises on top of the first error
            cause = cause.__context__
        raise NotCapturable(_first_line(cause)) from e
    torch.cuda.synchronize(device)
    return graph.replay, result

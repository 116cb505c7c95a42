"""Roofline floors per track: the least time any H200 kernel could take on a workload.

    floor_us = max(bytes_min / bandwidth, flops / peak) + t_lat

The byte and FLOP models are those of `../shared/notes/hopper_anchors.md` (§1 constants here;
each track's model in its folder's `floor.py`: `work(axes, inputs) -> Work`, reached through the
registry as `Track.floor_model`). Every byte counts as an HBM byte because the timer flushes
L2 before every call. `t_lat` is the measured CUPTI span of an empty kernel on the device
(1.15 us on our H200, hopper_anchors.md §8); the caller passes it in so that a floor
always goes with the machine it was measured on.

Without `inputs` the data-dependent quantities are estimated (each track's model says how).
With `inputs` (the workload's tensors by definition name) they are counted exactly.

Results rows use only exact floors: the worker records `trial_floor` of each timed trial's
inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

from hopperbench.results import TrialFloor
from hopperbench.tracks import Track, get_track

# hopper_anchors.md §1: copy bandwidth measured on our H200; bf16 dense rate measured; FP8 rate
# assumed from DeepGEMM's 1550 TFLOPS on H800 (same SM array).
H200_BANDWIDTH_BYTES_PER_S = 4.3e12
H200_PEAK_BF16_FLOP_PER_S = 790e12
H200_PEAK_FP8_FLOP_PER_S = 1.5e15


class FloorInputError(ValueError):
    """The axes or inputs given to `floor` do not describe a workload of the track."""


class Floor(BaseModel):
    """A roofline floor of one workload. Bytes and FLOP are expectations when estimated."""

    model_config = ConfigDict(frozen=True)

    bytes_min: float
    flops: float
    memory_us: float
    compute_us: float
    floor_us: float

    @property
    def core_us(self) -> float:
        """The floor without the empty-kernel span."""
        return max(self.memory_us, self.compute_us)


@dataclass(frozen=True)
class Work:
    """What a track's model counts for one workload: least HBM bytes, FLOP, and the peak rate of
    the kind of FLOP it does."""

    bytes_min: float
    flops: float
    peak_flop_per_s: float


def floor(
    track: Track | str,
    workload_axes: Mapping[str, int],
    *,
    t_lat_us: float,
    bandwidth: float = H200_BANDWIDTH_BYTES_PER_S,
    inputs: Mapping[str, object] | None = None,
) -> Floor:
    """The roofline floor of one workload of `track`.

    `workload_axes` are the workload's variable axes (e.g. `{"num_tokens": 8, "num_pages": 8462}`);
    `inputs`, when given, are the workload's inputs by definition name and make the
    data-dependent terms exact (which inputs each track's model reads, its `floor.py` says).
    """
    if t_lat_us < 0:
        raise FloorInputError(f"t_lat_us must be >= 0, got {t_lat_us}")
    if bandwidth <= 0:
        raise FloorInputError(f"bandwidth must be > 0 B/s, got {bandwidth}")
    entry = track if isinstance(track, Track) else get_track(track)
    work: Work = entry.floor_model.work(workload_axes, inputs)
    memory_us = work.bytes_min / bandwidth * 1e6
    compute_us = work.flops / work.peak_flop_per_s * 1e6
    return Floor(
        bytes_min=work.bytes_min,
        flops=work.flops,
        memory_us=memory_us,
        compute_us=compute_us,
        floor_us=max(memory_us, compute_us) + t_lat_us,
    )


# ------------------------------------------------------------------------------------------
# Shared by the tracks' models


def axis(track: str, axes: Mapping[str, int], name: str, minimum: int) -> int:
    """The workload axis `name` as an int of at least `minimum`."""
    if name not in axes:
        raise FloorInputError(f"{track}: workload axes lack {name!r} (got {sorted(axes)})")
    value = int(axes[name])
    if value < minimum:
        raise FloorInputError(f"{track}: axis {name!r} must be >= {minimum}, got {value}")
    return value


def tensor_input(track: str, inputs: Mapping[str, object], name: str) -> torch.Tensor:
    """The input `name`, which must be a tensor."""
    value = inputs.get(name)
    if not isinstance(value, torch.Tensor):
        raise FloorInputError(f"{track}: inputs lack tensor {name!r}")
    return value


# ------------------------------------------------------------------------------------------
# Per-trial floors of results rows


def trial_floor(track: Track | str, workload_axes: Mapping[str, int], inputs: Mapping[str, object]) -> TrialFloor:
    """The exact floor of one trial's inputs, without the empty-kernel span (each machine adds its own).

    May read GPU tensors and so synchronize; raises FloorInputError when the inputs do not fit the model."""
    f = floor(track, workload_axes, t_lat_us=0.0, inputs=inputs)
    return TrialFloor(bytes_min=f.bytes_min, core_us=f.core_us)



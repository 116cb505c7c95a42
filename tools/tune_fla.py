"""Pin the Triton configurations of the GDN track's fla side (`fla_chunk`) on this GPU.

    uv run tools/tune_fla.py [--tunings 5]   # a CUDA GPU, ~2 min per tuning on the H200; rewrites fla_gdn.PINNED_CONFIGS

fla's kernels autotune on their first call in a process, keyed without the token count, and their picks among
configurations within the timing noise of each other vary between processes (`fla_gdn`'s docstring). This tool
runs fla's own autotuner `--tunings` times, each in a fresh process with an empty Triton cache, on the inputs the
runner's side warm-up uses: the track's largest workload, and its largest no-state twin (another tuning key).
For every kernel and tuning key it keeps the configuration with the lowest median, over the tunings, of the
median time fla's autotuner measured for it, and writes them for this GPU into the generated block of
`hopperbench/tracks/gdn_prefill/adapters/fla_gdn.py` (other GPUs' entries kept). Then it prints, per kernel and
key, the kept configuration, its median and how many tunings picked it themselves.

Exits 2 with one line on stderr without CUDA or fla, or when a tuning process fails; nothing is written then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
ADAPTER = REPO_ROOT / "hopperbench" / "tracks" / "gdn_prefill" / "adapters" / "fla_gdn.py"
BLOCK_BEGIN = "# generated:fla-configs:begin\n"
BLOCK_END = "# generated:fla-configs:end\n"
VARIANTS = ("state", "no_state")  # the largest workload, then its largest no-state twin


class TuneError(RuntimeError):
    """Why no configuration was written."""


def config_fields(config: Any) -> dict[str, Any]:
    """The fields of a triton.Config that `fla_gdn.pin_configs` rebuilds it from; a configuration with a pre-hook or
    an IR override cannot be pinned that way."""
    if config.pre_hook is not None or getattr(config, "ir_override", None) is not None:
        raise TuneError(f"configuration {config} has a pre-hook or an IR override")
    return {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": config.num_ctas,
        "maxnreg": config.maxnreg,
    }


def choose(tunings: Sequence[Mapping[str, float]]) -> tuple[str, float, int]:
    """(the configuration, as its JSON, with the lowest median over `tunings` of its time in each; that median; how
    many tunings had it fastest). Each tuning maps a configuration's JSON to its time in ms; a configuration one
    tuning pruned is judged on the others."""
    times: dict[str, list[float]] = defaultdict(list)
    for tuning in tunings:
        for config, ms in tuning.items():
            times[config].append(ms)
    best = min(times, key=lambda config: (statistics.median(times[config]), config))
    own_picks = sum(1 for tuning in tunings if min(tuning, key=lambda config: (tuning[config], config)) == best)
    return best, statistics.median(times[best]), own_picks


def aggregate(records: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """`fla_gdn.PINNED_CONFIGS`' entries for one GPU from the tuning processes' records (kernel, key, timings: one
    record per kernel, key and tuning), kernels and keys sorted."""
    by_key: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for record in records:
        timings = {json.dumps(fields, sort_keys=True): ms for fields, ms in record["timings"]}
        by_key[(record["kernel"], json.dumps(record["key"]))].append(timings)
    pinned: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (kernel, key), tunings in sorted(by_key.items()):
        best, median_ms, own_picks = choose(tunings)
        pinned[kernel].append(
            {
                "key": json.loads(key),
                "config": json.loads(best),
                "median_ms": round(median_ms, 5),
                "picked_by": f"{own_picks} of {len(tunings)} tunings",
            }
        )
    return dict(pinned)


def rewrite_block(source: str, gpu: str, pinned: dict[str, list[dict[str, Any]]], existing: Mapping[str, Any]) -> str:
    """`source` (fla_gdn.py) with its generated block holding `existing` GPUs' entries and `pinned` for `gpu`."""
    begin, end = source.find(BLOCK_BEGIN), source.find(BLOCK_END)
    if begin < 0 or end < begin:
        raise TuneError(f"{ADAPTER} has no generated block ({BLOCK_BEGIN.strip()} ... {BLOCK_END.strip()})")
    table = {**existing, gpu: pinned}
    block = f"PINNED_CONFIGS: dict[str, dict[str, list[dict[str, Any]]]] = {pinned_literal(table)}\n"
    return source[: begin + len(BLOCK_BEGIN)] + block + source[end:]


def pinned_literal(table: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]) -> str:
    """`table` as a Python literal a reviewer can scan: GPUs and kernels sorted, one line per entry field."""
    if not table:
        return "{}"
    lines = ["{"]
    for gpu, kernels in sorted(table.items()):
        lines.append(f"    {gpu!r}: {{")
        for kernel, entries in sorted(kernels.items()):
            lines.append(f"        {kernel!r}: [")
            for entry in entries:
                lines.append("            {")
                lines += [f"                {field!r}: {value!r}," for field, value in entry.items()]
                lines.append("            },")
            lines.append("        ],")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


@contextlib.contextmanager
def recorded_autotuning() -> Iterator[list[dict[str, Any]]]:
    """While open, every tuning a Triton autotuner does is appended to the yielded list as (kernel, key,
    [(configuration fields, median ms)]): a tuning adds one key to the autotuner's cache per call, with its
    configurations' timings in `configs_timings`."""
    from triton.runtime.autotuner import Autotuner

    records: list[dict[str, Any]] = []
    untuned_run = Autotuner.run

    def recording_run(self: Autotuner, *args: Any, **kwargs: Any) -> Any:
        known = set(self.cache)
        result = untuned_run(self, *args, **kwargs)
        for key in set(self.cache) - known:
            records.append(
                {
                    "kernel": f"{self.base_fn.__module__}.{self.base_fn.__name__}",
                    "key": list(key),
                    "timings": [
                        [config_fields(config), ms[0] if isinstance(ms, (list, tuple)) else ms]
                        for config, ms in self.configs_timings.items()
                    ],
                }
            )
        return result

    Autotuner.run = recording_run
    try:
        yield records
    finally:
        Autotuner.run = untuned_run


def tuning_records(variant: str) -> list[dict[str, Any]]:
    """In this (fresh) process: one fla call on the runner's warm-up inputs of `variant`, every autotuning it does
    recorded (`recorded_autotuning`)."""
    import torch

    from hopperbench.runner import largest_workload, with_twins
    from hopperbench.synth import make_inputs
    from hopperbench.tracks import GDN_PREFILL
    from hopperbench.tracks.gdn_prefill.adapters import fla_gdn
    from hopperbench.workloads import load_workloads

    workloads = load_workloads(GDN_PREFILL.name)
    rows = with_twins(GDN_PREFILL, workloads, workloads)
    withheld = () if variant == "state" else (GDN_PREFILL.absent_input_sample.input,)
    workload = largest_workload(GDN_PREFILL, rows, withheld)
    inputs = make_inputs(GDN_PREFILL.name, workload, 0, 0, "cuda")
    chunk_gated_delta_rule = fla_gdn.import_chunk_gated_delta_rule()
    with recorded_autotuning() as records:
        chunk_gated_delta_rule(**fla_gdn.fla_arguments(*inputs.values()))
        torch.cuda.synchronize()
    return records


def run_tunings(tunings: int) -> list[dict[str, Any]]:
    """Every variant tuned `tunings` times, each in a fresh process with an empty Triton cache."""
    records = []
    for tuning in range(tunings):
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory(prefix="tune_fla_") as scratch:
                out = Path(scratch) / "records.json"
                env = {**os.environ, "TRITON_CACHE_DIR": str(Path(scratch) / "triton"), "FLA_CACHE_RESULTS": "0"}
                done = subprocess.run(
                    [sys.executable, __file__, "--child", variant, str(out)], env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    raise TuneError(f"tuning {tuning} ({variant}) failed: {last}")
                records += json.loads(out.read_text())
        print(f"tuning {tuning + 1} of {tunings} done", file=sys.stderr)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tunings", type=int, default=5, help="fresh processes per variant (5)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    if args.child:
        variant, out = args.child
        Path(out).write_text(json.dumps(tuning_records(variant)))
        return 0
    try:
        import torch

        if not torch.cuda.is_available():
            raise TuneError("needs a CUDA GPU")
        if args.tunings < 1:
            raise TuneError(f"--tunings must be >= 1, got {args.tunings}")
        from hopperbench.tracks.gdn_prefill.adapters import fla_gdn

        gpu = fla_gdn.gpu_key(torch.cuda.get_device_name())
        pinned = aggregate(run_tunings(args.tunings))
        if not pinned:
            raise TuneError("fla autotuned nothing")
        source = ADAPTER.read_text()
        ADAPTER.write_text(rewrite_block(source, gpu, pinned, fla_gdn.PINNED_CONFIGS))
    except TuneError as e:
        print(f"tune_fla: {e}", file=sys.stderr)
        return 2
    for kernel, entries in pinned.items():
        for entry in entries:
            print(f"{kernel} {entry['key']}: {entry['config']} {entry['median_ms']} ms ({entry['picked_by']})")
    print(f"pinned {sum(map(len, pinned.values()))} configurations for {gpu} in {ADAPTER.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

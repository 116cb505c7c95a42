"""Compare our kernels with the contest winners and the references on this GPU.

    uv run benchmarks/compare_human_best.py --track all

Flags: `--help`; implementation: hopperbench/runner.py.
"""

from hopperbench.runner import main

raise SystemExit(main())

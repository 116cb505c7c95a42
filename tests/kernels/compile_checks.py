"""The CPU check every kernel module's `compile_only` gets: it compiles for sm_90a without a GPU and caches."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def assert_compiles_and_caches(compile_only: Callable[[str], Sequence[Callable]], forms: int) -> Sequence[Callable]:
    """`compile_only("sm_90a")` gives `forms` distinct callables, and a second request gives the same ones (no
    recompilation); returns them for the caller's own checks."""
    compiled = compile_only("sm_90a")
    assert len(compiled) == forms and all(callable(fn) for fn in compiled)
    assert len({id(fn) for fn in compiled}) == forms
    assert compile_only("sm_90a") == compiled
    return compiled

"""Compile-time arguments without a GPU: row-major stand-in tensors (symbolic dimensions allowed) for the call's host
function (`host.fake_tensor_arguments`) and the TVM-FFI compile of a kernel's standalone launcher, the
`compiled()` that its GPU tests and probes call and whose PTX and cubin dumps its CPU tests read."""

from __future__ import annotations

from collections.abc import Callable

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream


def rowmajor(dtype, shape):
    """A compact row-major stand-in of `shape` (ints or `cute.sym_int`s), 16-B aligned."""
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)


def compile_standalone(launcher, tensors: tuple, arch: str, dump_dir: str = "") -> Callable:
    """`launcher(*tensors, num_ctas, stream)` compiled for `arch` with TVM-FFI, on the caller's torch stream; with
    `dump_dir` its PTX and cubin are also written there."""
    args = (*tensors, 0, make_fake_stream(use_tvm_ffi_env_stream=True))
    dump = f" --keep-ptx --keep-cubin --dump-dir={dump_dir}" if dump_dir else ""
    return cute.compile(launcher, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}{dump}")

#!/usr/bin/env bash
# Build (or resume building) the two FlashInfer 0.7.2.post1 modules the `flashinfer_moe` side loads, for
# sm_90a, on a CPU machine with CUDA 13.0 (third_party/README.md, "FlashInfer fused MoE": ~4-5 hours on
# 2 cores; ninja skips finished objects, so a stopped build resumes where it was):
#
#   FI_WHEEL=flashinfer_python-0.7.2.post1-py3-none-any.whl BUILD_DIR=/work/fi-moe-build \
#     setsid nohup tools/flashinfer_moe/build.sh >> /work/fi-moe-build/build.log 2>&1 </dev/null &
#
# FI_WHEEL is the full PyPI wheel (its flashinfer/data/ holds the sources). PYTHON needs torch (the
# repo's venv). CUDA 13.0's toolkit may lack the cuBLAS/cuRAND/NVRTC headers and the libcuda/libnvrtc
# link names: they come from the venv's nvidia cu13 wheels and an empty libcuda.so.1 stub (resolved by
# the driver on the GPU host), through FlashInfer's own FLASHINFER_EXTRA_* hooks. The stub defines no
# symbol, so the linker's default --as-needed would drop it and leave the module's driver calls
# (cuLibraryLoadData, ...) unbound: it is linked --no-as-needed, and the module must list libcuda.so.1.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
: "${BUILD_DIR:?set BUILD_DIR (kept across sessions; ninja resumes there)}"
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
SITE=${FI_SITE:-$BUILD_DIR/site}  # where the wheel is unpacked (FI_SITE: an existing unpack)
mkdir -p "$BUILD_DIR/extra/include" "$BUILD_DIR/extra/lib" "$BUILD_DIR/stubs/requests" "$BUILD_DIR/stubs/pynvml"
if [[ ! -d $SITE/flashinfer ]]; then
  : "${FI_WHEEL:?set FI_WHEEL to the flashinfer-python 0.7.2.post1 wheel from PyPI}"
  # A wheel is a zip and this one is pure Python with no .data folder: unpacking it is installing it
  # (the uv-made venv has no pip).
  "$PYTHON" -m zipfile -e "$FI_WHEEL" "$SITE"
fi
CU13=$("$PYTHON" -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13'))")
for h in "$CU13"/include/*.h; do [[ -e $CUDA_HOME/include/$(basename "$h") ]] || cp -n "$h" "$BUILD_DIR/extra/include/"; done
ln -sf "$CU13/lib/libnvrtc.so.13" "$BUILD_DIR/extra/lib/libnvrtc.so"
[[ -e $BUILD_DIR/extra/lib/libcuda.so ]] || echo "" | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$BUILD_DIR/extra/lib/libcuda.so"
# flashinfer.artifacts imports requests and flashinfer.utils pynvml (neither in the venv without the library
# extras); generating the ninja files calls neither.
for stub in requests pynvml; do
  [[ -e $BUILD_DIR/stubs/$stub/__init__.py ]] || echo '"""Stub: never called while ninja files are written."""' > "$BUILD_DIR/stubs/$stub/__init__.py"
done

export FLASHINFER_WORKSPACE_BASE=$BUILD_DIR/ws FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME PATH=$CUDA_HOME/bin:$PATH
export PYTHONPATH=$SITE:$BUILD_DIR/stubs
export FLASHINFER_EXTRA_CFLAGS="-isystem $BUILD_DIR/extra/include" FLASHINFER_EXTRA_CUDAFLAGS="-isystem $BUILD_DIR/extra/include"
export FLASHINFER_EXTRA_LDFLAGS="-L$BUILD_DIR/extra/lib -Wl,--no-as-needed -lcuda -Wl,--as-needed"
"$PYTHON" "$HERE/gen_ninja.py"
OPS=$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/0.7.2.post1/90a/cached_ops
for module in dsv3_fused_routing fused_moe_90; do
  echo "=== $module start $(date -u +%FT%TZ) jobs ${MAX_JOBS:-2}"
  ninja -C "$OPS/$module" -j "${MAX_JOBS:-2}" -k 0 || { echo "=== $module failed"; exit 1; }
done
needed=$(readelf -d "$OPS/fused_moe_90/fused_moe_90.so")
[[ $needed == *"[libcuda.so.1]"* ]] || { echo "fused_moe_90.so does not list libcuda.so.1: its driver calls would be unbound"; exit 1; }
echo "=== done $(date -u +%FT%TZ)"

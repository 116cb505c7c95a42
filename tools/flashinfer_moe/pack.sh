#!/usr/bin/env bash
# Pack the built modules and the deep_gemm headers FlashInfer's NVRTC path needs, for the GPU host
# (third_party/README.md, "FlashInfer fused MoE", install steps): DEST/{fused_moe_90.so.xz.part-*,
# dsv3_fused_routing.so, deep_gemm.tar, SHA256SUMS}. The compressed module is split in 30 MiB parts, so that
# each part travels in a device call of its own (64 MiB a call).   BUILD_DIR=... tools/flashinfer_moe/pack.sh DEST
set -euo pipefail
: "${BUILD_DIR:?set BUILD_DIR (where build.sh built)}"
DEST=${1:?usage: pack.sh DEST}
OPS=$BUILD_DIR/ws/.cache/flashinfer/0.7.2.post1/90a/cached_ops
for module in fused_moe_90 dsv3_fused_routing; do
  [[ -f $OPS/$module/$module.so ]] || { echo "pack.sh: $OPS/$module/$module.so is missing (build not finished)" >&2; exit 1; }
done
mkdir -p "$DEST"
rm -f "$DEST"/fused_moe_90.so.xz.part-*
xz -9 -T2 -c "$OPS/fused_moe_90/fused_moe_90.so" | split -b 30M - "$DEST/fused_moe_90.so.xz.part-"
cp "$OPS/dsv3_fused_routing/dsv3_fused_routing.so" "$DEST/"
tar cf "$DEST/deep_gemm.tar" -C "${FI_SITE:-$BUILD_DIR/site}/flashinfer/data/csrc/nv_internal/tensorrt_llm" deep_gemm
sha256sum "$OPS/fused_moe_90/fused_moe_90.so" "$OPS/dsv3_fused_routing/dsv3_fused_routing.so" > "$DEST/SHA256SUMS"
ls -la "$DEST"

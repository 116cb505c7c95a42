"""Write FlashInfer 0.7.2.post1's own build.ninja files for the two modules the `flashinfer_moe` side
loads, through FlashInfer's JIT machinery, into FLASHINFER_WORKSPACE_BASE (build.sh sets it):
`fused_moe_90` (gen_cutlass_fused_moe_sm90_module: the SM90 CUTLASS fused MoE with the DeepSeek FP8
block-scale path) and `dsv3_fused_routing` (gen_dsv3_fused_routing_module: fused_topk_deepseek). No
FlashInfer file is modified; ninja runs on the result.

One build-time selection: FlashInfer's generator also writes TensorRT-LLM's 48 dense fpA_intB GEMM
instantiations (generated/cutlass_instantiations/90/gemm/90/*.generated.cu, each only
`sm90_generic_mixed_gemm_kernelLauncher`), and the module compiles every *.generated.cu it finds
(flashinfer/jit/fused_moe.py:261). No source of the fused MoE module includes or calls that launcher
(third_party/README.md, "FlashInfer fused MoE"), so they are left out; the MoE instantiations all stay.
"""

from flashinfer.jit.dsv3_optimizations import gen_dsv3_fused_routing_module
from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

DENSE_GEMMS = "/cutlass_instantiations/90/gemm/90/"
DENSE_GEMM_UNITS = 48


def main() -> None:
    routing = gen_dsv3_fused_routing_module()
    moe = gen_cutlass_fused_moe_sm90_module()
    dense = [s for s in moe.sources if DENSE_GEMMS in s.as_posix()]
    if len(dense) != DENSE_GEMM_UNITS:
        raise SystemExit(f"gen_ninja: expected {DENSE_GEMM_UNITS} dense GEMM units, found {len(dense)}")
    moe.sources = [s for s in moe.sources if s not in dense]
    for spec in (routing, moe):
        spec.write_ninja()
        print(spec.name, len(spec.sources), "sources ->", spec.jit_library_path)


if __name__ == "__main__":
    main()

"""Sizes of the MoE definition and the tiling shared by the kernels of this folder."""

# ---- definition ----
NUM_EXPERTS = 256
NUM_LOCAL_EXPERTS = 32
HIDDEN = 7168
INTERMEDIATE = 2048
GEMM1_OUT = 2 * INTERMEDIATE
BLOCK = 128  # quantisation block (1 x 128 activations, 128 x 128 weights)
TOP_K = 8
NUM_GROUPS = 8
GROUP_SIZE = NUM_EXPERTS // NUM_GROUPS  # 32: one expert per lane and group
TOP_K_GROUPS = 4
NORMALISATION_EPS = 1e-20
HIDDEN_BLOCKS = HIDDEN // BLOCK  # 56
INTERMEDIATE_BLOCKS = INTERMEDIATE // BLOCK  # 16

# ---- tiling ----
NUM_THREADS = 128  # 4 warps per CTA

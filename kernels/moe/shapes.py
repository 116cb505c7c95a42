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
NUM_THREADS = 128  # 4 warps per CTA (GEMMs: 2 x 2 over the output tile; combine)
BLOCK_M = 64  # tokens (rows) per GEMM tile

# The packed workspaces (8 T rows of 7168 fp32) are addressed with 32-bit element offsets.
MAX_TOKENS = 32768
assert TOP_K * MAX_TOKENS * HIDDEN < 2**31


def max_row_tiles(num_tokens: int) -> int:
    """Upper bound on the GEMM row tiles of all experts together, from T alone.

    Sum over experts of ceil(n_e / 64) <= (A + 32 * 63) / 64 with A <= 8 T assignments, and each
    expert has at most T tokens."""
    per_assignment_bound = (TOP_K * num_tokens + BLOCK_M - 1) // BLOCK_M + NUM_LOCAL_EXPERTS
    per_expert_bound = NUM_LOCAL_EXPERTS * ((num_tokens + BLOCK_M - 1) // BLOCK_M)
    return min(per_assignment_bound, per_expert_bound)

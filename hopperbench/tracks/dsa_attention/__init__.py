"""The dsa_attention track: DSA sparse attention (DeepSeek sparse MLA over a paged cache, top-2048 keys per token).

This folder is the whole track: the spec below, `definition.json` (with `reference.py` embedded),
`reference.py`, `workloads.tsv`, `synth.py` (inputs), `floor.py` (roofline model) and
`adapters/` (library sides).
"""

from __future__ import annotations

from hopperbench.tracks.model import AcceptanceRule, LibrarySide, SizeClasses, Track

DSA_ATTENTION = Track(
    name="dsa_attention",
    package=__name__,
    definition_name="dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64",
    op_type="dsa_paged",
    acceptance=AcceptanceRule(atol=1e-2, rtol=1e-2, required_matched_ratio=1.0, outputs=("output", "lse")),
    kernel_entry="kernels/dsa_attention/kernel.py::run",
    human_key="dsa_attention",
    # One or two query tokens, and the rest (at most 8).
    size_classes=SizeClasses("num_tokens", (2,)),
    libraries=(
        LibrarySide(
            name="flashmla_sparse",
            entry="flashmla_dsa.py::run",
            description=(
                "FlashMLA flash_mla_sparse_fwd, SM90 sparse prefill on a bf16 cache stored in its "
                "packed 576-wide layout (16 heads padded to 64), deepseek-ai/FlashMLA@9241ae3"
            ),
            submodule="third_party/FlashMLA",
            package="flash_mla==1.0.0+9241ae3",
            prepare="prepare",
            timed_call=(
                "q padded to 64 heads (one torch copy), FlashMLA's sparse prefill kernel on the cache "
                "stored once, untimed, in its packed ckv|kpe layout, then the 16 heads' output and lse "
                "(base 2) copied out (3 torch kernels)"
            ),
        ),
        LibrarySide(
            name="fa3",
            entry="fa3_dsa.py::run",
            description=(
                "FlashAttention-3 flash_attn_with_kvcache, SM90 paged split-KV forward with qv (MLA: "
                "d 64 on kpe, dv 512 on ckv) over a page-size-1 table of each token's top-k rows, as "
                "SGLang's NSA fa3 decode backend calls it, Dao-AILab/flash-attention@0251105a"
            ),
            package="flash_attn_3==3.0.0+0251105a",
            prepare="prepare",
            timed_call=(
                "the index rows as a page-size-1 page table (their -1 padding last, checked untimed; "
                "their valid counts computed once per index tensor, as an engine does once per step), "
                "FA3's paged kernel with its split-KV "
                "combine on the cache viewed, untimed, as one-row pages (kpe rows as K, ckv rows as V, "
                "q_nope as qv), then output and lse (base 2) copied out (2 torch kernels)"
            ),
        ),
    ),
)

TRACK = DSA_ATTENTION

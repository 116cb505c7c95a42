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
    ),
)

TRACK = DSA_ATTENTION

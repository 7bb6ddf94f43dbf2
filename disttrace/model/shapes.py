"""Shape rules of the model that other layers need without building it (no torch): the manifest fills in
defaults with them, the planner counts parameters with them."""

from __future__ import annotations


def ffn_hidden_default(dim: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """LLaMA's SwiGLU width (Touvron et al. 2023, reference code `FeedForward`):
    start from 4*dim, take 2/3 of it (SwiGLU has three matrices instead of two, so this keeps the
    parameter count of a 4*dim two-matrix MLP), optionally scale, then round UP to a multiple of multiple_of.

        hidden = multiple_of * ceil(floor(8*dim/3) / multiple_of)

    LLaMA-7B: dim 4096, multiple_of 256 -> floor(10922.67) = 10922 -> 43 * 256 = 11008.
    """
    for name, v in (("dim", dim), ("multiple_of", multiple_of)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    hidden = (8 * dim) // 3  # int(2 * (4*dim) / 3), exactly, in integers
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * (-(-hidden // multiple_of))

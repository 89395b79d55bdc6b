"""attn_dispatch: per-runner attention kernel dispatch."""

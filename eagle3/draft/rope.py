"""Rotary position embeddings of the two draft kinds, exactly as vLLM 0.32 computes them when it serves the draft.

Pipeline position: part of the draft model (eagle3.draft.model), used by training, the offline reference and parity.

* llama kind: vLLM's default ``RotaryEmbedding``, neox style (the head's two halves rotate together), over the whole
  head (``rope_tables``; ``apply_neox``).
* mla kind: vLLM's ``DeepseekScalingRotaryEmbedding`` ("deepseek_yarn", model_executor/layers/rotary_embedding/
  deepseek_scaling_rope.py) over the qk_rope_head_dim part only, GPT-J style (interleaved pairs: vLLM hard-codes
  ``is_neox_style=False`` for DeepSeek attention), with yarn's frequency blend and cos/sin scaled by
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; the attention softmax scale gains
  ``mscale(factor, mscale_all_dim) ** 2`` (``mla_softmax_scale``). Without rope_scaling the MLA draft uses the
  default frequencies, still GPT-J style.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (neox-style) RoPE tables. position_ids: [B, T] -> cos, sin: [B, 1, T, head_dim] float32."""
    inv_freq = _default_inv_freq(head_dim, theta, position_ids.device)  # [head_dim / 2]
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, head_dim]
    return emb.cos(), emb.sin()


def apply_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, 1, T, head_dim] (halves rotate together)."""
    a, b = x.chunk(2, dim=-1)
    return (x * cos.to(x.dtype)) + (torch.cat([-b, a], dim=-1) * sin.to(x.dtype))


def mla_rope_tables(position_ids: torch.Tensor, rope_dim: int, theta: float,
                    scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-J-style tables for the MLA rope part. position_ids: [B, T] -> cos, sin: [B, 1, T, rope_dim] float32, each
    frequency repeated for its (even, odd) pair, yarn's mscale already applied."""
    device = position_ids.device
    if scaling:
        inv_freq, mscale = _yarn_inv_freq(rope_dim, theta, scaling, device)
    else:
        inv_freq, mscale = _default_inv_freq(rope_dim, theta, device), 1.0
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, rope_dim / 2]
    emb = freqs.repeat_interleave(2, dim=-1)[:, None]  # [B, 1, T, rope_dim]
    return emb.cos() * mscale, emb.sin() * mscale


def apply_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, rope_dim]; cos/sin: [B, 1, T, rope_dim] (pairs (2i, 2i + 1) rotate together)."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """vLLM's DeepseekV2MLAAttention scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 with yarn."""
    scale = qk_head_dim ** -0.5
    if scaling:
        m = _yarn_mscale(float(scaling["factor"]), float(scaling.get("mscale_all_dim") or 0))
        scale *= m * m
    return scale


def _default_inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))  # [dim / 2]


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2], cos/sin magnitude) of vLLM's DeepseekScalingRotaryEmbedding (yarn)."""
    factor, original = float(s["factor"]), int(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # vLLM's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp  # [dim / 2]: 1 = keep the original frequency (fast dims), 0 = interpolate
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    mscale = _yarn_mscale(factor, float(s.get("mscale", 1))) / _yarn_mscale(factor, float(s.get("mscale_all_dim", 0)))
    return inv_freq, mscale

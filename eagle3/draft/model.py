"""The EAGLE-3 draft model: exactly what vLLM's ``Eagle3LlamaForCausalLM`` (llama kind) or
``Eagle3DeepseekV2ForCausalLM`` (mla kind) computes at serving time.

Pipeline position: vocab + store -> **model** (used by train, validate, checkpoint). Its config: eagle3.draft.config.

Read against vLLM 0.32 ``model_executor/models/llama_eagle3.py``, ``deepseek_eagle3.py`` (+ ``deepseek_v2.py``'s
``DeepseekV2MLAAttention`` and ``layers/mla.py``) and ``v1/spec_decode/llm_base_proposer.py``. One decoder layer
(``midlayer``), per token::

    a      = input_norm(aux) or cat(fc_norm_i(aux_i))    # only with norm_before_fc / fc_norm; aux: [.., n_aux*H_t]
    h0     = fc(a)                                       # step-0 hidden input; [.., n_aux*H_t] -> [.., H]
    e      = input_layernorm(embed_tokens(token))        # frozen verifier embedding
    h_n    = hidden_norm(h)                              # h = h0, or the previous step's output (below)
    res    = h_n if norm_before_residual else h
    x      = cat([e, h_n])                               # [.., 2H]: the attention's projections take 2H inputs
    res    = o_proj(attention(x, rope(position))) + res  # llama: q/k/v heads; mla: DeepSeek latent attention
    out    = mlp(post_attention_layernorm(res)) + res    # PRE-norm output
    logits = lm_head(norm(out))                          # [.., draft_vocab]; target id = draft id + d2t[draft id]
    fed forward to the next draft step: out (the PRE-norm output), or norm(out) with norm_output

MLA attention (the mla kind), per head, as ``DeepseekV2MLAAttention``: q = q_b_proj(q_a_layernorm(q_a_proj(x)))
(or q_proj(x) without q_lora_rank) split into [q_nope, q_pe]; [c, k_pe] = kv_a_proj_with_mqa(x); [k_nope, v] =
kv_b_proj(kv_a_layernorm(c)); k = [k_nope, rope(k_pe)] with k_pe shared by every head; the softmax scale is
eagle3.draft.rope's. vLLM computes the same attention in the latent space (weights absorbed); the result is equal.

How vLLM pairs tokens, hidden states and positions (chain drafting, ``SpecDecodeBaseProposer.propose``)
------------------------------------------------------------------------------------------------------
The verifier has read tokens x_0 .. x_{n-1} (positions 0 .. n-1) and sampled x_n. Its aux states at position i,
a_i, are computed from x_0 .. x_i (they "predict" x_{i+1}).

* First pass (``set_inputs_first_pass``): the input ids are shifted left by one and the sampled token is put in
  the last slot, positions are NOT shifted:  position i  <-  (token x_{i+1}, hidden fc(a_i)),  i = 0 .. n-1.
  The output at the last position n-1 gives draft token d_1 (a guess of x_{n+1}) and its pre-norm output g_0.
* Draft step k >= 1: one new entry at position n-1+k with token d_k and hidden g_{k-1} (the PRE-norm output of
  the previous step at the previous position); it attends to the KV cache of every earlier entry: the context
  entries 0 .. n-1 (always fc(aux) features: the next first pass overwrites the slots of drafted positions) and the
  draft entries n .. n-1+k. Its output gives d_{k+1} and g_k.

So ONE plain causal forward over the sequence

    position : 0       1       ..  n-1        n       n+1     ..  n-1+k
    token    : x_1     x_2     ..  x_n        d_1     d_2     ..  d_k
    hidden   : fc(a_0) fc(a_1) ..  fc(a_{n-1}) g_0    g_1     ..  g_{k-1}

gives at its last position exactly vLLM's draft logits for d_{k+1} (``Eagle3Draft.forward`` with
``attention_mask=None``). Training (eagle3.train.trainer) unrolls the same computation for every context position at once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.draft.config import DraftConfig, DraftConfigError
from eagle3.draft.rope import apply_gptj, apply_neox, mla_rope_tables, mla_softmax_scale, rope_tables
from eagle3.support.verifier import (
    VerifierError,
    VerifierSpec,
    layer_tensor_names,
    load_verifier_head,
    read_layer,
    tensor_shapes,
    weight_map,
)


class RMSNorm(nn.Module):
    """vLLM/HF RMSNorm: statistics in float32, result cast back to the input dtype, then scaled."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rows(NamedTuple):
    """Entries of a [B, T] grid that one step computes (training: the entries its loss or later steps read,
    eagle3.train.ttt). ``index`` [N]: flat ``b * T + i``, ascending, padded by repeating its first entry (a CPU's
    oneDNN caches one kernel per matmul shape); the first ``real`` are the entries, the copies beyond are computed
    and never read. A step's projections, o_proj and MLP run on the N entries alone ([N, ..] "compact" tensors); the
    attention stays on the grid, its queries, keys and values scattered in (zeros elsewhere: an entry outside
    ``index`` is read by no one, since entry i of a later step attends only to the step-0 context and to its own
    earlier steps, and every entry of a step is an entry of the step before)."""

    index: torch.Tensor  # [N] int64
    real: int
    batch: int  # B
    length: int  # T

    def gather(self, grid: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]."""
        return grid.flatten(0, 1)[self.index]

    def scatter(self, compact: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...]: the real entries in place, zeros elsewhere (the padding copies are left out, so
        each entry's gradient arrives once)."""
        grid = _ScatterRows.apply(compact, self.index, self.real, self.batch * self.length)
        return grid.view(self.batch, self.length, *compact.shape[1:])


class _ScatterRows(torch.autograd.Function):
    """compact [N, ...] -> grid [G, ...]: rows index[:real] of the grid = compact[:real], zeros elsewhere. Keeps only
    the index for backward (torch's index_copy also keeps the source it copies: one [N, ..] tensor per scatter)."""

    @staticmethod
    def forward(ctx, compact: torch.Tensor, index: torch.Tensor, real: int, size: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.real, ctx.rows = real, compact.shape[0]
        grid = compact.new_zeros(size, *compact.shape[1:])
        return grid.index_copy_(0, index[:real], compact[:real])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows, *grad.shape[1:])  # the padding copies' rows get none
        out[:ctx.real] = grad.index_select(0, index[:ctx.real])
        return out, None, None, None


def _on_grid(y: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    """A projection's output on the [B, T, ..] grid: as it is when it was computed there (no ``rows``, or a [B, T, ..]
    input), scattered from its compact [N, ..] form otherwise."""
    return y if rows is None or y.dim() == 3 else rows.scatter(y)


def _query_input(x: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    """The attention input the queries read: x itself, or its ``rows`` when x is on the grid (step 0: keys and values
    for every context entry, queries only where the step's output is read)."""
    return x if rows is None or x.dim() == 2 else rows.gather(x)


class KVCache:
    """Keys/values of the earlier training-time-test steps (see eagle3.train.ttt for the step layout).

    ``keys[0]`` / ``values[0]`` are step 0 over all T entries (attended causally inside each packed sample);
    ``keys[s]`` for s >= 1 are step s at the same entries (each entry attends only to its own, the diagonal).
    Shapes: keys [B, kv_heads, T, head_dim], values [B, kv_heads, T, value_head_dim] (MLA: kv_heads = heads, keys
    qk_nope + qk_rope wide, values v_head_dim wide).
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
               ) -> torch.Tensor:
        """Append this step's k, v and attend: q [B, heads, T, hd] over [step-0 keys (``mask`` [B, 1, T, T]), steps
        1 .. now (diagonal only)] -> [B, heads, T, value_head_dim]."""
        if q.device.type == "cpu":  # contiguous, so the written-out attention's matmuls keep them, not copies
            self.keys.append(k.contiguous())
            self.values.append(v.contiguous())
            return _explicit_attention(q, self.keys, self.values, mask, scale)
        self.keys.append(k)
        self.values.append(v)
        steps = len(self.keys)
        if steps == 1:
            return _sdpa(q, k, v, mask, scale)
        b, t = q.shape[0], q.shape[2]
        eye = torch.eye(t, dtype=torch.bool, device=q.device).expand(b, 1, t, t)
        full_mask = torch.cat([mask] + [eye] * (steps - 1), dim=-1)  # [B, 1, T, steps * T]
        return _sdpa(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2), full_mask, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            cache: KVCache | None) -> torch.Tensor:
    """Masked self-attention over this step's keys alone (no cache), or over the cached steps too."""
    return _sdpa(q, k, v, mask, scale) if cache is None else cache.attend(q, k, v, mask, scale)


def _explicit_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The training-time test's attention written out, for a CPU: q [B, heads, T, hd]; keys[s] [B, kv, T, hd] and
    values[s] [B, kv, T, vd] (contiguous) of steps s = 0 .. S-1; mask [B, 1, T, T] bool over step 0 -> [B, heads, T, vd].

    The context (step 0) is one masked [T, T] score block per head; each later step adds one score per entry, its
    own key (the diagonal), as an elementwise product, where SDPA over the concatenated keys computes a whole [T, T]
    block per step to keep one entry of each row. SmolLM2's draft (9 heads, T = 512, 3 steps, bf16 autocast) on 2
    cores of an AMD EPYC: 79 against 198 ms of attention forward + backward per 2-row micro-batch (SDPA's fused CPU
    kernel is slower even on step 0 alone), 1.19x the trainer's tokens/s (interleaved in one process). It keeps the
    probabilities [B, heads, T, T + S - 1] for backward (eagle3.train.memory plans them), and its backward rounds
    differently with the thread count (~1e-7), where SDPA's did not. CUDA keeps SDPA's fused kernels, which never
    hold the [T, T] scores (Kimi-K2.5's 64 heads at 2,048 tokens: 0.5 GB a row in bf16)."""
    rep = q.shape[1] // keys[0].shape[1]
    if rep > 1:  # GQA: each kv head serves `rep` query heads
        keys = [k.repeat_interleave(rep, dim=1) for k in keys]
        values = [v.repeat_interleave(rep, dim=1) for v in values]
    q = (q * scale).contiguous()  # one copy that the score matmul and the later steps' products share
    t = q.shape[2]
    scores = torch.matmul(q, keys[0].transpose(-1, -2)).masked_fill(mask.logical_not(), float("-inf"))  # [B, nh, T, T]
    own = [(q * k).sum(-1, keepdim=True) for k in keys[1:]]  # [B, heads, T, 1] per later step: q_i . k_i
    p = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)  # [B, heads, T, T + S - 1]
    out = torch.matmul(p[..., :t], values[0])  # [B, heads, T, vd]
    for s, v in enumerate(values[1:]):
        out = out + p[..., t + s:t + s + 1] * v
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, heads, T, hd]; k: [B, kv, S, hd]; v: [B, kv, S, vd]; mask: [B, 1, T, S] bool -> [B, heads, T, vd]."""
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves heads / kv query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class Eagle3Attention(nn.Module):
    """The llama kind's attention: vLLM's ``LlamaAttention`` of the EAGLE-3 layer (q/k/v take [e, h_n], GQA, neox
    RoPE over the whole head)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None, rows: Rows | None = None) -> torch.Tensor:
        """x: [B, T, 2H]; position_ids: [B, T]; mask: [B, 1, T, T] bool (True = may attend) over the step-0 keys.

        Without a cache this is ordinary masked self-attention. With earlier steps in the cache, the keys are
        [step-0 keys (masked by ``mask``), step-1 .. current-step keys (diagonal only)].

        With ``rows`` (``Rows``) the output is [N, H], at those entries only; x is [B, T, 2H] (keys and values at
        every entry, queries at ``rows``) or [N, 2H] (everything at ``rows``).
        """
        b, t = position_ids.shape
        cos, sin = rope_tables(position_ids, self.head_dim, self.theta)  # [B, 1, T, hd]
        q = _on_grid(self.q_proj(_query_input(x, rows)), rows)  # [B, T, heads * hd]
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k = _on_grid(self.k_proj(x), rows).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, hd]
        v = _on_grid(self.v_proj(x), rows).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, hd]
        q, k = apply_neox(q, cos, sin), apply_neox(k, cos, sin)
        out = _attend(q, k, v, mask, 1.0 / math.sqrt(self.head_dim), cache)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)  # [B, T, heads * hd]
        return self.o_proj(out if rows is None else rows.gather(out))  # [B, T, H] or [N, H]


class Eagle3MLAAttention(nn.Module):
    """The mla kind's attention: vLLM's ``DeepseekV2MLAAttention`` with a 2H-wide input (deepseek_eagle3.py), in the
    expanded form (keys and values per head; vLLM's absorbed latent form computes the same)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h2 = 2 * cfg.hidden_size
        self.heads, self.nope, self.rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank, self.q_rank = cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
        self.theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.scale = mla_softmax_scale(self.nope + self.rope, cfg.rope_scaling)
        qk = self.heads * (self.nope + self.rope)
        if self.q_rank:
            self.q_a_proj = nn.Linear(h2, self.q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(h2, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None, rows: Rows | None = None) -> torch.Tensor:
        """As ``Eagle3Attention.forward``; x: [B, T, 2H] -> [B, T, H] (with ``rows``: x [B, T, 2H] or [N, 2H] ->
        [N, H])."""
        b, t = position_ids.shape
        xq = _query_input(x, rows)  # [B, T, 2H] or [N, 2H]
        q_in = self.q_a_layernorm(self.q_a_proj(xq)) if self.q_rank else xq  # [.., q_rank] or [.., 2H]
        q = _on_grid((self.q_b_proj if self.q_rank else self.q_proj)(q_in), rows)  # [B, T, heads * (nope + rope)]
        q = q.view(b, t, self.heads, self.nope + self.rope).transpose(1, 2)  # [B, heads, T, nope + rope]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)  # [.., kv], [.., r]
        kv = _on_grid(self.kv_b_proj(self.kv_a_layernorm(latent)), rows)  # [B, T, heads * (nope + v_dim)]
        k_pe = _on_grid(k_pe, rows)  # [B, T, r]
        kv = kv.view(b, t, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)  # [B, heads, T, nope], [.., v_dim]
        cos, sin = mla_rope_tables(position_ids, self.rope, self.theta, self.rope_scaling)  # [B, 1, T, r]
        q_pe = apply_gptj(q[..., self.nope:], cos, sin)  # [B, heads, T, r]
        k_pe = apply_gptj(k_pe[:, None], cos, sin)  # [B, 1, T, r]: one rope key shared by every head
        q = torch.cat([q[..., :self.nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, self.heads, t, self.rope)], dim=-1)  # [B, heads, T, nope + rope]
        out = _attend(q, k, v.contiguous(), mask, self.scale, cache)  # [B, heads, T, v_dim]
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.v_dim)  # [B, T, heads * v_dim]
        return self.o_proj(out if rows is None else rows.gather(out))  # [B, T, H] or [N, H]


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """vLLM's EAGLE-3 decoder layer with layer_idx 0 (the checkpoint calls it ``midlayer``); the attention is the
    kind's."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3MLAAttention(cfg) if cfg.kind == "mla" else Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None, rows: Rows | None = None) -> torch.Tensor:
        """embeds, hidden: [B, T, H] -> PRE-norm output [B, T, H] (vLLM's ``hidden_prenorm``). With ``rows``: the
        output at those entries, [N, H]; embeds and hidden are both [B, T, H] (step 0) or both [N, H]."""
        e = self.input_layernorm(embeds)
        h_n = self.hidden_norm(hidden)
        residual = h_n if self.norm_before_residual else hidden
        x = torch.cat([e, h_n], dim=-1)  # [B, T, 2H] or [N, 2H]
        residual = self.self_attn(x, position_ids, mask, cache, rows) + _query_input(residual, rows)
        return self.mlp(self.post_attention_layernorm(residual)) + residual


# ----------------------------------------------------------------------------- the draft


# init_from_layer: the llama draft's layer weights a verifier decoder layer supplies, draft parameter -> verifier
# tensor (the tail after ``layers.<k>.``). q/k/v read [e, h_n]: the verifier's matrix becomes their h_n half.
LAYER_INIT = {
    "midlayer.hidden_norm.weight": "input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "mlp.down_proj.weight",
}
HALF_INPUT = tuple(f"midlayer.self_attn.{x}_proj.weight" for x in "qkv")


def check_init_layer(config: DraftConfig, verifier_path: str | Path, layer: int,
                     where: str = "train.init_from_layer") -> tuple[int, dict[str, str]]:
    """Whether a draft of ``config`` can start as the verifier's decoder layer ``layer`` (``init_from_layer``),
    from the verifier's config.json, weight names and safetensors header shapes only (no tensor data is read: the
    capacity plan asks this before anything is regenerated or extracted). Returns (the layer as a non-negative id,
    the verifier's weight map).

    Refused with a DraftConfigError naming ``where``: a draft kind other than llama; a layer the verifier lacks; a
    verifier layer that is not a plain Llama layer (any tensor besides LAYER_INIT's: MLA attention, MoE experts,
    biases, q/k norms, Gemma's extra norms, FP8 scales) or whose MLP is not silu; draft widths or rope_theta other
    than the verifier's; a layer tensor whose shape in the weights' headers is not what the draft's parameter takes
    (a config.json that does not match its weights). (A verifier's rope_scaling is not the draft's concern here: a
    llama draft computes default RoPE either way.)"""
    if config.kind != "llama":
        raise DraftConfigError(f"{where}: starting from a verifier layer is implemented for the llama draft kind, "
                               f"not {config.kind!r}")
    try:
        spec = VerifierSpec.from_path(verifier_path)
        n_layers = spec.num_hidden_layers
        if not -n_layers <= layer < n_layers:
            raise DraftConfigError(f"{where}: {layer} is not a decoder layer of the verifier {verifier_path} "
                                   f"(layers 0 .. {n_layers - 1}, or -1 .. -{n_layers} from the last)")
        layer %= n_layers
        act = spec.text_config.get("hidden_act") or spec.text_config.get("hidden_activation") or "silu"
        if act != "silu":
            raise DraftConfigError(f"{where}: the verifier's MLP uses {act!r}, the draft's silu: its layer {layer} "
                                   f"would compute something else here")
        default = DraftConfig.build(spec, config.draft_vocab_size, config.aux_layer_ids,
                                    torch_dtype=config.torch_dtype)
        differ = [f"{k} {getattr(config, k)} (verifier {getattr(default, k)})"
                  for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta")
                  if getattr(config, k) != getattr(default, k)]
        if differ:
            raise DraftConfigError(f"{where}: the draft's {', '.join(differ)} differ from the verifier's layer; leave "
                                   f"train.draft's widths and rope_theta unset")
        wmap = weight_map(verifier_path)
        # old Llama checkpoints store the RoPE frequencies per layer: not a weight
        names = {t: n for t, n in layer_tensor_names(verifier_path, layer, wmap).items()
                 if not t.endswith("rotary_emb.inv_freq")}
        extra, missing = sorted(set(names) - set(LAYER_INIT.values())), sorted(set(LAYER_INIT.values()) - set(names))
        if extra or missing:
            has = f"it also has {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}" if extra else ""
            lacks = f"it lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}" if missing else ""
            raise DraftConfigError(f"{where}: the verifier's layer {layer} is not a plain Llama layer the draft can "
                                   f"start from ({'; '.join(x for x in (has, lacks) if x)})")
        shapes = tensor_shapes(verifier_path, list(names.values()), wmap)  # headers only
    except VerifierError as e:
        raise DraftConfigError(f"{where}: {e}") from None
    with torch.device("meta"):  # the draft's parameter shapes, no memory
        params = dict(Eagle3Draft(config).named_parameters())
    for name, tail in LAYER_INIT.items():
        rows, *cols = params[name].shape
        takes = (rows, cols[0] - config.hidden_size) if name in HALF_INPUT else (rows, *cols)
        if shapes[names[tail]] != takes:
            raise DraftConfigError(f"{where}: the verifier's layer {layer} {tail} is {shapes[names[tail]]} in its "
                                   f"weights, the draft's {name} takes {takes} (its config.json's widths do not match "
                                   f"its weights?)")
    return layer, wmap


class Eagle3Draft(nn.Module):
    """Parameters named exactly as the checkpoint contract (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, optional
    ``input_norm`` / ``fc_norm.<i>``, buffers ``d2t`` / ``t2d``, frozen ``embed_tokens``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        fc_in = cfg.n_aux * cfg.target_hidden_size
        if cfg.norm_before_fc:  # vLLM's `input_norm`: one norm over the concatenated aux states
            self.input_norm = RMSNorm(fc_in, cfg.rms_norm_eps)
        if cfg.fc_norm:  # one norm per aux state
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.n_aux))
        self.fc = nn.Linear(fc_in, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's embedding, frozen
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [draft_vocab]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # [target_vocab]

    # --- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_verifier(cls, cfg: DraftConfig, verifier_path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor,
                      seed: int = 0, init_layer: int | None = None) -> Eagle3Draft:
        """New draft: seeded init, frozen embedding = the verifier's, ``lm_head`` = the verifier's lm_head rows of
        the draft vocab, ``norm`` = the verifier's final norm (so lm_head(norm(h)) starts as the verifier's head).
        ``init_layer`` k: the layer starts as the verifier's decoder layer k instead (``init_from_layer``)."""
        if len(d2t) != cfg.draft_vocab_size or len(t2d) != cfg.vocab_size:
            raise DraftConfigError(f"vocab mapping sizes d2t {len(d2t)} / t2d {len(t2d)} do not match draft_vocab_size "
                                   f"{cfg.draft_vocab_size} / vocab_size {cfg.vocab_size}")
        torch.manual_seed(seed)
        draft = cls(cfg)
        draft_ids = torch.arange(len(d2t)) + d2t  # [draft_vocab] target ids, ascending
        head = load_verifier_head(verifier_path, draft_ids)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(head.embed_tokens)
            draft.lm_head.weight.copy_(head.lm_head)
            draft.norm.weight.copy_(head.norm_weight)
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        if init_layer is not None:
            draft.init_from_layer(verifier_path, init_layer)
        return draft

    def init_from_layer(self, verifier_path: str | Path, layer: int) -> None:
        """Start the draft's decoder layer as the verifier's decoder layer ``layer`` (vLLM's id k: the layer whose
        input is the residual stream k; negative counts from the last, -1 = the last layer): its norms, o_proj and
        MLP as they are, and its q/k/v as the half of the draft's q/k/v that reads the hidden state h_n; the half
        that reads the token embedding e keeps its seeded init. With that half at zero (and norm_before_residual
        off) the layer computes exactly the verifier's layer on h (tests/test_model.py). Refused as
        ``check_init_layer`` refuses, before any tensor is read."""
        where = "train.init_from_layer"
        layer, wmap = check_init_layer(self.config, verifier_path, layer, where)
        try:
            tensors = read_layer(verifier_path, layer, tuple(LAYER_INIT.values()), wmap)
        except VerifierError as e:
            raise DraftConfigError(f"{where}: {e}") from None
        params = dict(self.named_parameters())
        hidden = self.config.hidden_size
        with torch.no_grad():  # shapes checked by check_init_layer
            for name, tail in LAYER_INIT.items():
                target = params[name][:, hidden:] if name in HALF_INPUT else params[name]
                target.copy_(tensors[tail].to(target.dtype))

    # --- serving computation ------------------------------------------------------------------------------------

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux * H_target] (aux states concatenated in aux_layer_ids order) -> [..., H]: vLLM's
        ``combine_hidden_states`` (input_norm, then the per-state fc_norm, then fc)."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(self.config.n_aux, dim=-1))],
                            dim=-1)
        return self.fc(aux)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
             cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the layer. input_ids, position_ids: [B, T]; hidden: [B, T, H]; mask: [B, 1, T, T] bool.

        Returns (the hidden state the next draft step reads [B, T, H]: the PRE-norm output, or the normed one with
        norm_output; logits [B, T, draft_vocab]).
        """
        fed, normed = self.step_features(input_ids, hidden, position_ids, mask, cache)
        return fed, self.head(normed)

    def step_features(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                      mask: torch.Tensor, cache: KVCache | None = None, rows: Rows | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` without the head: (the hidden state fed forward, the normed output [B, T, H] that ``head``
        reads). The training-time test applies ``head`` only at the entries its loss reads, and with ``rows`` the
        layer computes only at those entries (``Rows``): both outputs are then [N, H]; input_ids and position_ids
        stay [B, T], hidden is [B, T, H] (step 0) or [N, H] (the previous step's output at the same entries)."""
        if rows is not None and hidden.dim() == 2:
            input_ids = rows.gather(input_ids)  # [N]
        prenorm = self.midlayer(self.embed_tokens(input_ids), hidden, position_ids, mask, cache, rows)
        normed = self.norm(prenorm)
        return (normed if self.config.norm_output else prenorm), normed

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] normed outputs -> [..., draft_vocab] logits."""
        return self.lm_head(normed)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (target-vocab ids), position_ids: [B, T]; hidden: [B, T, H] (fc(aux) or earlier outputs);
        attention_mask: [B, T, T] bool (True = may attend), default plain causal.

        Returns (the hidden fed forward [B, T, H], logits [B, T, draft_vocab]). See the module docstring for how a
        chain of vLLM draft steps maps onto one such call.
        """
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril().expand(b, t, t)
        return self.step(input_ids, hidden, position_ids, attention_mask[:, None])

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (d2t is an offset table)."""
        return ids + self.d2t[ids]

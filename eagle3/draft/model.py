"""The EAGLE-3 draft model: exactly what vLLM's ``Eagle3LlamaForCausalLM`` computes at serving time.

Pipeline position: vocab + store -> **model** (used by train, validate, checkpoint).

Read against vLLM 0.32 ``model_executor/models/llama_eagle3.py`` and ``v1/spec_decode/llm_base_proposer.py``.
One decoder layer (``midlayer``), per token::

    h0     = fc(cat(aux_hidden_states))                  # step-0 hidden input; [.., n_aux*H_t] -> [.., H]
    e      = input_layernorm(embed_tokens(token))        # frozen verifier embedding
    h_n    = hidden_norm(h)                              # h = h0, or the previous step's PRE-norm output
    res    = h_n if norm_before_residual else h
    x      = cat([e, h_n])                               # [.., 2H]: q/k/v projections take 2H inputs
    res    = o_proj(attention(x, rope(position))) + res
    out    = mlp(post_attention_layernorm(res)) + res    # PRE-norm output: fed forward to the next draft step
    logits = lm_head(norm(out))                          # [.., draft_vocab]; target id = draft id + d2t[draft id]

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
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from eagle3.support.verifier import VerifierSpec, load_verifier_head

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # vLLM maps both to Eagle3LlamaForCausalLM;
ARCHITECTURE = ARCHITECTURES[0]  # the one this project writes
# config options vLLM implements but this model (hence training and the offline reference) does not
UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


class DraftConfigError(ValueError):
    """Draft settings that cannot form a model vLLM would load; the message names the field."""


class DraftArchitecture(BaseModel):
    """User-facing draft architecture knobs; ``None`` = take the verifier's value (see ``DraftConfig.build``).

    The draft's hidden size always equals the verifier's, so the frozen verifier embedding is shared (vLLM shares the
    target's ``embed_tokens`` when the checkpoint omits it, which is valid only at equal width).
    """

    model_config = ConfigDict(extra="forbid")

    intermediate_size: int | None = Field(
        None, gt=0, description="MLP width in units (None: the verifier's intermediate_size; Kimi-K2: 18432).")
    num_attention_heads: int | None = Field(
        None, gt=0, description="Query heads (None: the verifier's num_attention_heads).")
    num_key_value_heads: int | None = Field(
        None, gt=0, description="Key/value heads (None: the verifier's num_key_value_heads, else = query heads).")
    head_dim: int | None = Field(
        None, gt=0, description="Per-head width in units (None: verifier head_dim; v_head_dim for MLA verifiers; else "
        "hidden / heads).")
    rope_theta: float | None = Field(
        None, gt=0, description="RoPE base (None: the verifier's rope_theta, else 10000). Default RoPE only.")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Longest position the draft serves, in tokens (None: the verifier's).")
    norm_before_residual: bool = Field(
        False, description="vLLM `norm_before_residual`: the residual stream starts from hidden_norm(h) instead "
        "of h.")


class DraftConfig(BaseModel):
    """The resolved draft config; maps 1:1 onto the flat config.json vLLM reads (``to_vllm_config``)."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(gt=0, description="Draft hidden width in units (= verifier hidden size).")
    target_hidden_size: int = Field(gt=0, description="Verifier hidden width in units (each aux state's width).")
    intermediate_size: int = Field(gt=0, description="MLP width in units.")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads (GQA when fewer than query heads).")
    head_dim: int = Field(gt=0, description="Per-head width in units.")
    vocab_size: int = Field(gt=0, description="Verifier (target) vocabulary size in tokens: embedding rows.")
    draft_vocab_size: int = Field(gt=0, description="Draft output vocabulary size in tokens: lm_head rows.")
    aux_layer_ids: list[int] = Field(
        min_length=1, description="Verifier layers whose states feed fc, vLLM convention (id k = residual stream "
        "ENTERING decoder layer k = HF hidden_states[k]).")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (default rope type).")
    max_position_embeddings: int = Field(2048, gt=0, description="Longest position in tokens.")
    norm_before_residual: bool = Field(False, description="vLLM norm_before_residual option.")
    hidden_act: str = Field("silu", description="MLP activation (vLLM's Llama MLP supports silu only).")
    torch_dtype: str = Field("bfloat16", description="dtype the checkpoint's weights are saved in.")

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)

    def model_post_init(self, _context: Any) -> None:
        if self.draft_vocab_size > self.vocab_size:
            raise DraftConfigError(f"draft_vocab_size {self.draft_vocab_size} is larger than the target vocab_size "
                                   f"{self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise DraftConfigError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.hidden_act != "silu":
            raise DraftConfigError(f"hidden_act {self.hidden_act!r}: only 'silu' is supported")

    @classmethod
    def build(cls, spec: VerifierSpec, draft_vocab_size: int, aux_layer_ids: list[int],
              arch: DraftArchitecture | None = None, torch_dtype: str | None = None) -> DraftConfig:
        """Draft config from the verifier's config (``spec``) and the user's ``arch`` overrides."""
        arch = arch or DraftArchitecture()
        text = spec.text_config
        aux_layer_ids = spec.resolve_aux_layer_ids(aux_layer_ids)
        heads = arch.num_attention_heads or int(text.get("num_attention_heads") or 0)
        if not heads:
            raise DraftConfigError(f"verifier {spec.path} has no num_attention_heads: set num_attention_heads")
        # an explicit head count without a kv count means plain multi-head attention
        kv = arch.num_key_value_heads or (heads if arch.num_attention_heads
                                          else int(text.get("num_key_value_heads") or heads))
        # MLA verifiers (DeepSeek-V3 / Kimi) call the RoPE part `head_dim`; the draft is plain attention and takes
        # the value head width (Kimi-K2: 128, as the public AQ-MedAI draft)
        mla = "kv_lora_rank" in text
        head_dim = arch.head_dim or int(text.get("v_head_dim" if mla else "head_dim") or 0) or (
            spec.hidden_size // heads)
        rope = text.get("rope_parameters") or {}
        theta = arch.rope_theta or float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        inter = arch.intermediate_size or int(text.get("intermediate_size") or 0)
        if not inter:
            raise DraftConfigError(f"verifier {spec.path} has no intermediate_size: set intermediate_size")
        return cls._make(
            f"draft config for {spec.path}",
            hidden_size=spec.hidden_size, target_hidden_size=spec.hidden_size, intermediate_size=inter,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=spec.vocab_size,
            draft_vocab_size=draft_vocab_size, aux_layer_ids=[int(k) for k in aux_layer_ids],
            rms_norm_eps=spec.rms_norm_eps, rope_theta=theta,
            max_position_embeddings=arch.max_position_embeddings or int(text.get("max_position_embeddings", 2048)),
            norm_before_residual=arch.norm_before_residual, torch_dtype=torch_dtype or spec.dtype,
        )

    @classmethod
    def _make(cls, where: str, **fields: Any) -> DraftConfig:
        """Construct, turning pydantic's validation errors into one DraftConfigError naming the fields."""
        try:
            return cls(**fields)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
                             for err in e.errors())
            raise DraftConfigError(f"{where}: {msgs}") from None

    def to_vllm_config(self) -> dict[str, Any]:
        """Flat config.json for vLLM (AQ-MedAI Kimi-K2 layout). Aux layer ids (vLLM convention) appear at the top
        level AND in ``eagle_config``: some vLLM versions read only one of them and otherwise fall back to
        (2, L//2, L-3) silently."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
            "torch_dtype": self.torch_dtype,
        }

    @classmethod
    def from_vllm_config(cls, cfg: dict[str, Any], where: str = "config.json") -> DraftConfig:
        """Inverse of ``to_vllm_config`` (checks the fields this implementation supports)."""
        if not isinstance(cfg, dict):
            raise DraftConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        if cfg.get("architectures") not in ([a] for a in ARCHITECTURES):
            raise DraftConfigError(f"{where}: architectures {cfg.get('architectures')} is not [{ARCHITECTURE!r}]")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise DraftConfigError(f"{where}: num_hidden_layers {cfg['num_hidden_layers']}: only 1 is supported")
        for key in UNSUPPORTED_OPTIONS:
            if cfg.get(key) or (cfg.get("eagle_config") or {}).get(key):
                raise DraftConfigError(f"{where}: option {key} is not supported by eagle3.draft.model")
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        if not aux:
            raise DraftConfigError(f"{where}: eagle_aux_hidden_state_layer_ids missing")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise DraftConfigError(f"{where}: rope_type {rope['rope_type']!r}: only 'default' is supported")
        try:
            heads = int(cfg["num_attention_heads"])
            return cls._make(
                where,
                hidden_size=cfg["hidden_size"], target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
                intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
                draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"], aux_layer_ids=list(aux),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                hidden_act=cfg.get("hidden_act", "silu"), torch_dtype=str(cfg.get("torch_dtype", "bfloat16")),
            )
        except KeyError as e:
            raise DraftConfigError(f"{where}: missing key {e.args[0]}") from None
        except (TypeError, ValueError) as e:
            raise DraftConfigError(f"{where}: a field has a value of the wrong type ({e})") from None

    def matmul_params(self) -> int:
        """Weights used in matmuls per token (fc, attention, MLP, lm_head); 2 FLOPs each in a forward."""
        h, hd = self.hidden_size, self.head_dim
        attn = 2 * h * hd * (self.num_attention_heads + 2 * self.num_key_value_heads) + \
            self.num_attention_heads * hd * h
        return (self.n_aux * self.target_hidden_size * h + attn + 3 * h * self.intermediate_size
                + self.draft_vocab_size * h)


# ----------------------------------------------------------------------------- building blocks


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


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (neox-style) RoPE tables. position_ids: [B, T] -> cos, sin: [B, 1, T, head_dim] float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
                                / head_dim))  # [head_dim / 2]
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, head_dim]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, 1, T, head_dim]."""
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


class KVCache:
    """Keys/values of the earlier training-time-test steps (see eagle3.train.trainer for the step layout).

    ``keys[0]`` / ``values[0]`` are step 0 over all T entries (attended causally inside each packed sample);
    ``keys[s]`` for s >= 1 are step s at the same entries (each entry attends only to its own, the diagonal).
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # each [B, kv_heads, T, head_dim]
        self.values: list[torch.Tensor] = []


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        """x: [B, T, 2H]; mask: [B, 1, T, T] bool (True = may attend) over the step-0 keys.

        Without a cache (or with an empty one) this is ordinary masked self-attention. With earlier steps in the
        cache, the keys are [step-0 keys (masked by ``mask``), step-1 .. current-step keys (diagonal only)].
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, hd]
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.keys.append(k)
            cache.values.append(v)
        if cache is None or len(cache.keys) == 1:
            out = _sdpa(q, k, v, mask)
        else:
            steps = len(cache.keys)
            eye = torch.eye(t, dtype=torch.bool, device=x.device).expand(b, 1, t, t)
            full_mask = torch.cat([mask] + [eye] * (steps - 1), dim=-1)  # [B, 1, T, steps * T]
            out = _sdpa(q, torch.cat(cache.keys, dim=2), torch.cat(cache.values, dim=2), full_mask)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)  # [B, T, heads * hd]
        return self.o_proj(out)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, heads, T, hd]; k, v: [B, kv, S, hd]; mask: [B, 1, T, S] bool -> [B, heads, T, hd]."""
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves heads / kv query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """vLLM's ``llama_eagle3.LlamaDecoderLayer`` with layer_idx 0 (the checkpoint calls it ``midlayer``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """embeds, hidden: [B, T, H] -> PRE-norm output [B, T, H] (vLLM's ``hidden_prenorm``)."""
        e = self.input_layernorm(embeds)
        h_n = self.hidden_norm(hidden)
        residual = h_n if self.norm_before_residual else hidden
        x = torch.cat([e, h_n], dim=-1)  # [B, T, 2H]
        residual = self.self_attn(x, cos, sin, mask, cache) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


# ----------------------------------------------------------------------------- the draft


class Eagle3Draft(nn.Module):
    """Parameters named exactly as the checkpoint contract (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, buffers
    ``d2t`` / ``t2d``, frozen ``embed_tokens``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
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
                      seed: int = 0) -> Eagle3Draft:
        """New draft: seeded init, frozen embedding = the verifier's, ``lm_head`` = the verifier's lm_head rows of
        the draft vocab, ``norm`` = the verifier's final norm (so lm_head(norm(h)) starts as the verifier's head)."""
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
        return draft

    # --- serving computation ------------------------------------------------------------------------------------

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: [..., n_aux * H_target] (aux states concatenated in aux_layer_ids order) -> [..., H]."""
        return self.fc(aux)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
             cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the layer. input_ids, position_ids: [B, T]; hidden: [B, T, H]; mask: [B, 1, T, T] bool.

        Returns (PRE-norm output [B, T, H], logits [B, T, draft_vocab]).
        """
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        prenorm = self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, mask, cache)
        return prenorm, self.lm_head(self.norm(prenorm))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (target-vocab ids), position_ids: [B, T]; hidden: [B, T, H] (fc(aux) or earlier pre-norm
        outputs); attention_mask: [B, T, T] bool (True = may attend), default plain causal.

        Returns (PRE-norm hidden [B, T, H], logits [B, T, draft_vocab]). See the module docstring for how a chain
        of vLLM draft steps maps onto one such call.
        """
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril().expand(b, t, t)
        return self.step(input_ids, hidden, position_ids, attention_mask[:, None])

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (d2t is an offset table)."""
        return ids + self.d2t[ids]

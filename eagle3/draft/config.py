"""The draft's configuration: the user's architecture knobs, the resolved config, and its vLLM config.json.

Pipeline position: vocab + store -> **draft config** (train builds it from the verifier) -> model / checkpoint /
validate. Two draft kinds, each exactly a draft class vLLM 0.32 serves:

    kind   vLLM class (architectures)                          attention                          config model_type
    llama  Eagle3LlamaForCausalLM (LlamaForCausalLMEagle3)     q/k/v/o over [e, h_n] (2H), GQA    llama
    mla    Eagle3DeepseekV2ForCausalLM (Eagle3DeepseekV3...)   DeepSeek MLA over [e, h_n]: the    deepseek_v2
                                                               verifier's latent widths and rope

An MLA draft's config says ``model_type: deepseek_v2`` on purpose: vLLM's speculative config rewrites a
``deepseek_v3`` draft config into DeepSeek's MTP module (``SpeculativeConfig.hf_config_override``), whatever its
``architectures`` say. Which kinds vLLM can serve beside which verifier on which platform is
``serving_pair_problem`` (CPU: the MLA backend's KV blocks are 16 tokens, CPU attention needs multiples of 32).

Options shared with vLLM (speculators' "EAGLE 3.1" turns on the first and third, SpecForge none):
``norm_before_fc`` (one RMSNorm over the concatenated aux states before fc; Llama kind only, vLLM's MLA draft has
none), ``fc_norm`` (one RMSNorm per aux state before fc), ``norm_output`` (the hidden state fed to the next draft
step is the normed output, not the pre-norm one), ``norm_before_residual`` (the residual starts from hidden_norm(h)).
Layer ids use vLLM's convention: id k = the residual stream ENTERING decoder layer k (HF hidden_states[k]).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3.support.settings import SETTINGS_MODEL
from eagle3.support.verifier import VerifierSpec

DraftKind = Literal["llama", "mla"]
# architectures vLLM maps to each kind's draft class; the first is the one this project writes
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"),
    "mla": ("Eagle3DeepseekV3ForCausalLM", "Eagle3DeepseekV2ForCausalLM"),
}
MODEL_TYPES: dict[str, str] = {"llama": "llama", "mla": "deepseek_v2"}
MLA_WIDTHS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROPE_TYPES: dict[str, tuple[str, ...]] = {"llama": ("default",), "mla": ("default", "yarn")}  # what the model computes
# vLLM options this implementation (hence training and the offline reference) does not compute
UNSUPPORTED_OPTIONS = ("use_parallel_drafting",)


class DraftConfigError(ValueError):
    """Draft settings that cannot form a model vLLM would load; the message names the field."""


def kind_of_architecture(architectures: Any) -> str | None:
    """The draft kind a config.json's ``architectures`` names (None: no EAGLE-3 draft this project writes)."""
    for kind, names in ARCHITECTURES.items():
        if architectures in ([a] for a in names):
            return kind
    return None


def serving_pair_problem(verifier_mla: bool, kind: str, platform: str) -> str | None:
    """Why vLLM cannot serve a ``kind`` draft beside a verifier with (``verifier_mla``) or without MLA attention on
    ``platform`` ("cpu" / "cuda"), as one sentence naming the setting to change; None when it can.

    vLLM 0.32 on CPU: an MLA model's KV blocks are 16 tokens (CPU_MLA) and the Llama-style attention needs multiples
    of 32 (CPU_ATTN), so the engine refuses the pair at start ("No common block size for 16"); measured with the
    kimi-mini verifier. On CUDA the FlashAttention / FlashMLA backends share block sizes (the public Kimi drafts of
    both kinds are served there)."""
    if platform != "cpu" or verifier_mla == (kind == "mla"):
        return None
    verifier = "an MLA verifier (DeepSeek / Kimi attention)" if verifier_mla else "a verifier without MLA attention"
    want = "mla" if verifier_mla else "llama"
    return (f"vLLM's CPU build cannot serve a {kind} draft beside {verifier}: their KV-cache backends share no block "
            f"size (CPU_MLA blocks are 16 tokens, CPU_ATTN needs multiples of 32); set train.draft.kind: {want}")


class DraftArchitecture(BaseModel):
    """User-facing draft architecture knobs; ``None`` = take the verifier's value (see ``DraftConfig.build``).

    The draft's hidden size always equals the verifier's, so the frozen verifier embedding is shared (vLLM shares the
    target's ``embed_tokens`` when the checkpoint omits it, which is valid only at equal width).
    """

    model_config = SETTINGS_MODEL

    kind: DraftKind = Field(
        "llama", description="The draft's attention: 'llama' (vLLM's Eagle3LlamaForCausalLM: q/k/v heads) or 'mla' "
        "(vLLM's Eagle3DeepseekV3ForCausalLM: DeepSeek multi-head latent attention with the verifier's latent widths "
        "and rope; needs an MLA verifier such as Kimi-K2.5). vLLM's CPU build serves only the kind that matches the "
        "verifier's attention.")
    intermediate_size: int | None = Field(
        None, gt=0, description="MLP width in units (None: the verifier's intermediate_size; Kimi-K2: 18432).")
    num_attention_heads: int | None = Field(
        None, gt=0, description="Query heads (None: the verifier's num_attention_heads).")
    num_key_value_heads: int | None = Field(
        None, gt=0, description="Key/value heads of a llama draft (None: the verifier's num_key_value_heads, else = "
        "query heads). An MLA draft has one latent K/V per token and as many K/V heads as query heads.")
    head_dim: int | None = Field(
        None, gt=0, description="Per-head width of a llama draft in units (None: verifier head_dim; v_head_dim for MLA "
        "verifiers; else hidden / heads). An MLA draft takes qk_nope_head_dim + qk_rope_head_dim from the verifier.")
    rope_theta: float | None = Field(
        None, gt=0, description="RoPE base (None: the verifier's rope_theta, else 10000).")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Longest position the draft serves, in tokens (None: the verifier's).")
    norm_before_residual: bool = Field(
        False, description="vLLM `norm_before_residual`: the residual stream starts from hidden_norm(h) instead "
        "of h.")
    norm_before_fc: bool = Field(
        False, description="vLLM `norm_before_fc` (speculators' EAGLE 3.1): one RMSNorm over the concatenated aux "
        "states before fc. Llama kind only (vLLM's MLA draft has none).")
    fc_norm: bool = Field(
        False, description="vLLM `fc_norm` (the EAGLE 3.1 paper's variant): one RMSNorm per aux state before fc.")
    norm_output: bool = Field(
        False, description="vLLM `norm_output` (speculators' EAGLE 3.1): the hidden state fed to the next draft "
        "step is the draft's normed output instead of its pre-norm output.")


class DraftConfig(BaseModel):
    """The resolved draft config; maps 1:1 onto the flat config.json vLLM reads (``to_vllm_config``)."""

    model_config = ConfigDict(extra="forbid")

    kind: DraftKind = Field("llama", description="'llama' or 'mla' (see DraftArchitecture.kind).")
    hidden_size: int = Field(gt=0, description="Draft hidden width in units (= verifier hidden size).")
    target_hidden_size: int = Field(gt=0, description="Verifier hidden width in units (each aux state's width).")
    intermediate_size: int = Field(gt=0, description="MLP width in units.")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads (GQA when fewer than query heads; MLA: "
                                     "= query heads).")
    head_dim: int = Field(gt=0, description="Per-head query/key width in units (MLA: qk_nope + qk_rope).")
    vocab_size: int = Field(gt=0, description="Verifier (target) vocabulary size in tokens: embedding rows.")
    draft_vocab_size: int = Field(gt=0, description="Draft output vocabulary size in tokens: lm_head rows.")
    aux_layer_ids: list[int] = Field(
        min_length=1, description="Verifier layers whose states feed fc, vLLM convention (id k = residual stream "
        "ENTERING decoder layer k = HF hidden_states[k]).")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="MLA kind: the verifier's yarn rope parameters (factor, original_max_position_embeddings, "
        "beta_fast, beta_slow, mscale, mscale_all_dim); None = default rope.")
    max_position_embeddings: int = Field(2048, gt=0, description="Longest position in tokens.")
    q_lora_rank: int | None = Field(None, gt=0, description="MLA: query latent rank (None: a direct q_proj).")
    kv_lora_rank: int | None = Field(None, gt=0, description="MLA: key/value latent rank (Kimi-K2.5: 512).")
    qk_nope_head_dim: int | None = Field(None, gt=0, description="MLA: per-head query/key width without RoPE.")
    qk_rope_head_dim: int | None = Field(None, gt=0, description="MLA: per-head query/key width with RoPE (the "
                                         "key's rope part is shared by all heads).")
    v_head_dim: int | None = Field(None, gt=0, description="MLA: per-head value width.")
    norm_before_residual: bool = Field(False, description="vLLM norm_before_residual option.")
    norm_before_fc: bool = Field(False, description="vLLM norm_before_fc option (llama kind).")
    fc_norm: bool = Field(False, description="vLLM fc_norm option.")
    norm_output: bool = Field(False, description="vLLM norm_output option.")
    hidden_act: str = Field("silu", description="MLP activation (vLLM's draft MLPs support silu only).")
    torch_dtype: str = Field("bfloat16", description="dtype the checkpoint's weights are saved in.")

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def value_head_dim(self) -> int:
        """Per-head width of the values and of the attention output (o_proj's input per head)."""
        return self.v_head_dim if self.kind == "mla" else self.head_dim

    def model_post_init(self, _context: Any) -> None:
        if self.draft_vocab_size > self.vocab_size:
            raise DraftConfigError(f"draft_vocab_size {self.draft_vocab_size} is larger than the target vocab_size "
                                   f"{self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise DraftConfigError(f"hidden_act {self.hidden_act!r}: only 'silu' is supported")
        rope_type = (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type") or "default"
        if rope_type not in ROPE_TYPES[self.kind]:
            raise DraftConfigError(f"rope type {rope_type!r} is not supported by a {self.kind} draft (supported: "
                                   f"{', '.join(ROPE_TYPES[self.kind])})")
        if self.kind == "llama":
            if self.head_dim % 2:
                raise DraftConfigError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
            if any(getattr(self, k) is not None for k in MLA_WIDTHS):
                raise DraftConfigError(f"{', '.join(MLA_WIDTHS)} are MLA widths: a llama draft takes none")
            return
        missing = [k for k in MLA_WIDTHS if k != "q_lora_rank" and getattr(self, k) is None]
        if missing:
            raise DraftConfigError(f"an MLA draft needs {', '.join(missing)}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise DraftConfigError("an MLA draft has as many key/value heads as query heads (num_key_value_heads "
                                   f"{self.num_key_value_heads} != num_attention_heads {self.num_attention_heads})")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise DraftConfigError(f"an MLA draft's head_dim is qk_nope_head_dim + qk_rope_head_dim = "
                                   f"{self.qk_nope_head_dim + self.qk_rope_head_dim}, not {self.head_dim}")
        if self.qk_rope_head_dim % 2:
            raise DraftConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.norm_before_fc:
            raise DraftConfigError("norm_before_fc is a llama-draft option: vLLM's MLA draft (deepseek_eagle3.py) has "
                                   "no input norm; use fc_norm")

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
        inter = arch.intermediate_size or int(text.get("intermediate_size") or 0)
        if not inter:
            raise DraftConfigError(f"verifier {spec.path} has no intermediate_size: set intermediate_size")
        rope = text.get("rope_parameters") or {}
        theta = arch.rope_theta or float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        common = dict(  # noqa: C408 - reads like the config it is
            kind=arch.kind, hidden_size=spec.hidden_size, target_hidden_size=spec.hidden_size, intermediate_size=inter,
            num_attention_heads=heads, vocab_size=spec.vocab_size, draft_vocab_size=draft_vocab_size,
            aux_layer_ids=[int(k) for k in aux_layer_ids], rms_norm_eps=spec.rms_norm_eps, rope_theta=theta,
            max_position_embeddings=arch.max_position_embeddings or int(text.get("max_position_embeddings", 2048)),
            norm_before_residual=arch.norm_before_residual, norm_before_fc=arch.norm_before_fc,
            fc_norm=arch.fc_norm, norm_output=arch.norm_output, torch_dtype=torch_dtype or spec.dtype)
        where = f"draft config for {spec.path}"
        if arch.kind == "mla":
            if not spec.mla:
                raise DraftConfigError(f"{where}: an MLA draft takes its latent widths and rope from an MLA verifier "
                                       f"(DeepSeek-V3 / Kimi attention); {spec.path} has none: set train.draft.kind: "
                                       f"llama")
            if arch.num_key_value_heads or arch.head_dim:
                raise DraftConfigError(f"{where}: num_key_value_heads / head_dim are llama-draft knobs; an MLA draft "
                                       f"takes its widths from the verifier")
            widths = {k: (int(text[k]) if text.get(k) is not None else None) for k in MLA_WIDTHS}
            return cls._make(where, **common, num_key_value_heads=heads, **widths,
                             head_dim=(widths["qk_nope_head_dim"] or 0) + (widths["qk_rope_head_dim"] or 0),
                             rope_scaling=_yarn_parameters(text))
        # an explicit head count without a kv count means plain multi-head attention
        kv = arch.num_key_value_heads or (heads if arch.num_attention_heads
                                          else int(text.get("num_key_value_heads") or heads))
        # MLA verifiers (DeepSeek-V3 / Kimi) call the RoPE part `head_dim`; a llama draft is plain attention and takes
        # the value head width (Kimi-K2: 128, as the public AQ-MedAI draft)
        head_dim = arch.head_dim or int(text.get("v_head_dim" if spec.mla else "head_dim") or 0) or (
            spec.hidden_size // heads)
        return cls._make(where, **common, num_key_value_heads=kv, head_dim=head_dim)

    @classmethod
    def _make(cls, where: str, **fields: Any) -> DraftConfig:
        """Construct, turning pydantic's validation errors into one DraftConfigError naming the fields."""
        try:
            return cls(**fields)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
                             for err in e.errors())
            raise DraftConfigError(f"{where}: {msgs}") from None
        except DraftConfigError as e:
            raise DraftConfigError(f"{where}: {e}") from None

    def to_vllm_config(self) -> dict[str, Any]:
        """Flat config.json for vLLM (the AQ-MedAI Kimi-K2 layout for a llama draft; DeepseekV2 fields for an MLA
        draft). Aux layer ids (vLLM convention) appear at the top level AND in ``eagle_config``: some vLLM versions
        read only one of them and otherwise fall back to (2, L//2, L-3) silently. Every option is written out, false
        included: vLLM's speculators-format path reads a missing norm_before_residual as true."""
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.kind][0]],
            "model_type": MODEL_TYPES[self.kind],
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
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True, "norm_before_fc": self.norm_before_fc},
            "torch_dtype": self.torch_dtype,
        }
        if self.kind == "llama":
            cfg["mlp_bias"] = False
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
            return cfg
        cfg.update({k: getattr(self, k) for k in MLA_WIDTHS})
        cfg["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return cfg

    @classmethod
    def from_vllm_config(cls, cfg: dict[str, Any], where: str = "config.json") -> DraftConfig:
        """Inverse of ``to_vllm_config`` (checks the fields this implementation supports)."""
        if not isinstance(cfg, dict):
            raise DraftConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        kind = kind_of_architecture(cfg.get("architectures"))
        if kind is None:
            known = ", ".join(f"[{names[0]!r}]" for names in ARCHITECTURES.values())
            raise DraftConfigError(f"{where}: architectures {cfg.get('architectures')} is none of {known}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise DraftConfigError(f"{where}: num_hidden_layers {cfg['num_hidden_layers']}: only 1 is supported")
        for key in UNSUPPORTED_OPTIONS:
            if cfg.get(key) or (cfg.get("eagle_config") or {}).get(key):
                raise DraftConfigError(f"{where}: option {key} is not supported by eagle3.draft")
        eagle = cfg.get("eagle_config") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if not aux:
            raise DraftConfigError(f"{where}: eagle_aux_hidden_state_layer_ids missing")
        rope = cfg.get("rope_parameters") or {}
        if kind == "llama" and rope.get("rope_type", "default") != "default":
            raise DraftConfigError(f"{where}: rope_type {rope['rope_type']!r}: only 'default' is supported")
        try:
            heads = int(cfg["num_attention_heads"])
            mla = {k: cfg.get(k) for k in MLA_WIDTHS} if kind == "mla" else {}
            return cls._make(
                where, kind=kind,
                hidden_size=cfg["hidden_size"], target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
                intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or ((mla["qk_nope_head_dim"] or 0) + (mla["qk_rope_head_dim"] or 0)
                                                 if mla else cfg["hidden_size"] // heads),
                vocab_size=cfg["vocab_size"],
                draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"], aux_layer_ids=list(aux),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
                rope_scaling=cfg.get("rope_scaling") if kind == "mla" else None,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
                fc_norm=bool(cfg.get("fc_norm", False)), norm_output=bool(cfg.get("norm_output", False)),
                hidden_act=cfg.get("hidden_act", "silu"), torch_dtype=str(cfg.get("torch_dtype", "bfloat16")), **mla,
            )
        except KeyError as e:
            raise DraftConfigError(f"{where}: missing key {e.args[0]}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, DraftConfigError):
                raise
            raise DraftConfigError(f"{where}: a field has a value of the wrong type ({e})") from None

    def attention_params(self) -> int:
        """Parameters of the attention block (its input is [e, h_n]: 2H wide)."""
        h2, h, nh = 2 * self.hidden_size, self.hidden_size, self.num_attention_heads
        if self.kind == "llama":
            hd = self.head_dim
            return h2 * hd * (nh + 2 * self.num_key_value_heads) + nh * hd * h
        r, kv, vd = self.qk_rope_head_dim, self.kv_lora_rank, self.v_head_dim
        q = (h2 * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nh * self.head_dim
             if self.q_lora_rank else h2 * nh * self.head_dim)  # q_a_proj + q_a_layernorm + q_b_proj, or q_proj
        return q + h2 * (kv + r) + kv + kv * nh * (self.qk_nope_head_dim + vd) + nh * vd * h

    def fc_norm_params(self) -> int:
        """Parameters of the norms before fc (norm_before_fc's one, fc_norm's n_aux)."""
        width = self.n_aux * self.target_hidden_size
        return width * (int(self.norm_before_fc) + int(self.fc_norm))

    def matmul_params(self) -> int:
        """Weights used in matmuls per token (fc, attention, MLP, lm_head); 2 FLOPs each in a forward."""
        return (self.n_aux * self.target_hidden_size * self.hidden_size + self.attention_params()
                + 3 * self.hidden_size * self.intermediate_size + self.draft_vocab_size * self.hidden_size)


def _yarn_parameters(text: dict[str, Any]) -> dict[str, Any] | None:
    """The verifier's rope scaling as an MLA draft writes it (None for default rope). Kimi-K2.5 ships
    ``rope_scaling: {type: yarn, ...}``; transformers 5 names it ``rope_parameters`` with ``rope_type``."""
    params = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("rope_theta", None)
    if kind == "default":
        return None
    return {"type": kind, **params}

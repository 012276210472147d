"""Checkpoint validation: the vLLM contract on files, real vLLM speculative decoding, an offline parity check.

Pipeline position: train -> checkpoint -> **validate** -> serve.

1. ``validate_checkpoint(draft_dir, verifier_path)`` reads config.json and the safetensors HEADER (then each float
   tensor once, for NaN/Inf) and checks them against the verifier and ../shared/EAGLE3_FACTS.md. Every failure is
   one ``Finding`` with a stable ``code`` and a message that names the field or tensor; the report lists them all.
2. ``run_vllm_check`` runs ``eagle3.validate.vllm_check`` in the vLLM interpreter (its own process group, killed on timeout or
   cancellation, see eagle3.support.subproc): vLLM loads the verifier with the draft as its EAGLE-3 speculator, greedy-
   generates on held-out chat prompts, reports acceptance from ``llm.get_metrics()``, and generates again without
   speculation: the token ids must be identical (temperature 0 is lossless).
3. ``eagle3.validate.specdec.offline_acceptance`` (optional, ``offline_reference``) computes the same figures with a
   transformers verifier and our draft; they must agree with vLLM's within ``parity_tolerance``.
4. ``write_report`` writes report.json, report.md (markdown tables) and acceptance.png (per-position acceptance).

``validate_draft`` runs 1 -> 2 -> 3 -> 4 and gives the verdict; ``tasks/validate.py`` wraps it for Prefect.
Layer ids are in vLLM's convention everywhere: id k = residual stream ENTERING decoder layer k = HF hidden_states[k].
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open

from eagle3.support.io import atomic_write_json, atomic_write_text, sha256_file
from eagle3.support.paths import REPO_ROOT, resolve_path, vllm_python, vllm_subprocess_env
from eagle3.support.subproc import SubprocessFailed, run_subprocess
from eagle3.support.verifier import VerifierError, VerifierSpec
from eagle3.validate.vllm_check import read_prompt_messages

log = logging.getLogger("eagle3")

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
RUN_INFO = "eagle3_run.json"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "num_hidden_layers", "vocab_size", "draft_vocab_size", "rms_norm_eps", "max_position_embeddings")
# options vLLM implements but eagle3.draft.model (hence training and the offline reference) does not
UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FLOAT_DTYPES = {"float32", "bfloat16", "float16", "float64"}
_NONFINITE_CHUNK_ROWS = 4096  # rows per isfinite() slice, so a 163840-row embedding never doubles in memory


class ValidateConfig(BaseModel):
    """Settings of the validation stage (structural check, vLLM run, offline parity, verdict)."""

    model_config = ConfigDict(extra="forbid")

    prompts_path: str = Field(
        "data/stdlib-chat/eval.openai.jsonl", description="Held-out chat conversations (OpenAI or ShareGPT jsonl); "
        "the first user turn of each (after its system message) is the prompt. Relative paths: to the checkout.")
    num_prompts: int = Field(8, gt=0, description="Prompts to generate on, in conversations (the first N of the file).")
    max_new_tokens: int = Field(64, gt=0, description="Generation budget per prompt, in tokens.")
    num_speculative_tokens: int = Field(
        3, gt=0, description="Draft tokens proposed per verifier step (vLLM num_speculative_tokens), in tokens.")
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM tensor parallel size, in devices (Kimi-K2.5: 8).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype vLLM runs the verifier and draft in; float32 on CPU, bfloat16 on GPUs.")
    max_model_len: int | None = Field(
        None, gt=0, description="vLLM max_model_len in tokens (None: the verifier's max_position_embeddings).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vLLM gpu_memory_utilization as a fraction of device memory (None: vLLM's "
        "default, 0.9). Ignored on CPU (VLLM_CPU_KVCACHE_SPACE, GiB, sets the KV cache there).")
    enforce_eager: bool = Field(True, description="vLLM enforce_eager: no CUDA graphs / torch.compile (faster start).")
    engine_in_process: bool = Field(
        True, description="Run vLLM's engine core in the check's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
        "one interpreter start less, ~10 s on CPU.")
    trust_remote_code: bool = Field(False, description="Let transformers/vLLM run the verifier's own Python code "
                                    "(Kimi-K2.5's tokenizer needs it).")
    timeout_s: float = Field(1800.0, gt=0, description="Wall-clock limit of the vLLM subprocess, in seconds; its "
                             "whole process group is killed past it.")
    vllm_python: str | None = Field(
        None, description="Interpreter of the vLLM environment (None: $EAGLE3_VLLM_PYTHON, else .venv-vllm).")
    run_vllm: bool = Field(True, description="Run the vLLM check (false: structural check only; verdict then says so).")
    require_lossless: bool = Field(True, description="Fail when speculative and plain greedy outputs differ.")
    min_mean_acceptance_length: float | None = Field(
        None, ge=1, description="Fail below this vLLM mean acceptance length (tokens per verifier step); None: no "
        "threshold.")
    compare_untrained: bool = Field(
        False, description="Also run an UNTRAINED draft (same config, vocab mapping and init as the trainer's step 0) "
        "in the same vLLM process and report its acceptance beside the trained one's; fails the verdict when "
        "training gained nothing. Costs one more engine start (a verifier load: ~22 min for Kimi-K2.5).")
    offline_reference: bool = Field(
        False, description="Also run the offline reference (transformers verifier + our draft, eagle3.validate.specdec) on "
        "the same prompts and compare. Needs the verifier to fit in this process: tiny verifiers only.")
    parity_tolerance: float = Field(
        0.10, gt=0, description="Largest relative difference between offline and vLLM mean acceptance length "
        "(fraction, 0.10 = 10%).")


# ----------------------------------------------------------------------------- 1. structural validation


@dataclass
class Finding:
    code: str  # stable identifier, e.g. "aux_ids_out_of_range"
    message: str  # names the file, field or tensor, and what was expected


@dataclass
class ValidationReport:
    draft_dir: str
    verifier_path: str
    failures: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.failures]

    def fail(self, code: str, message: str) -> None:
        self.failures.append(Finding(code, message))

    def warn(self, code: str, message: str) -> None:
        self.warnings.append(Finding(code, message))

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "draft_dir": self.draft_dir, "verifier_path": self.verifier_path,
                "failures": [asdict(f) for f in self.failures], "warnings": [asdict(f) for f in self.warnings],
                "summary": self.summary}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_config(cfg: dict, spec: VerifierSpec, rep: ValidationReport, where: str) -> dict[str, Any] | None:
    """Config checks; returns the resolved dimensions the weight checks need (None when the config is unusable)."""
    nested = [k for k in ("text_config", "transformer_layer_config", "llm_config") if isinstance(cfg.get(k), dict)]
    if nested or ("hidden_size" not in cfg and any(isinstance(v, dict) and "hidden_size" in v for v in cfg.values())):
        key = nested[0] if nested else next(k for k, v in cfg.items() if isinstance(v, dict) and "hidden_size" in v)
        rep.fail("config_nested", f"{where} is nested (the draft's fields are under {key!r}); vLLM's "
                 f"Eagle3LlamaForCausalLM reads a FLAT config: hidden_size, vocab_size, draft_vocab_size, ... and "
                 f"eagle_aux_hidden_state_layer_ids at the top level")
        return None
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        rep.fail("config_missing_keys", f"{where} lacks {', '.join(missing)}")
        return None
    bad = [k for k in REQUIRED_KEYS if k != "rms_norm_eps" and (not _is_int(cfg[k]) or cfg[k] <= 0)]
    if bad:
        rep.fail("config_bad_value", f"{where}: {', '.join(f'{k}={cfg[k]!r}' for k in bad)} must be positive integers")
        return None

    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
        rep.fail("architectures", f"{where}: architectures is {archs!r}; vLLM maps EAGLE-3 Llama drafts from "
                 f"[{ARCHITECTURES[0]!r}] (or [{ARCHITECTURES[1]!r}])")
    if cfg.get("model_type") != "llama":
        rep.fail("model_type", f"{where}: model_type is {cfg.get('model_type')!r}, expected 'llama'")
    if cfg["num_hidden_layers"] != 1:
        rep.fail("num_hidden_layers", f"{where}: num_hidden_layers is {cfg['num_hidden_layers']}; the draft has "
                 f"one decoder layer (midlayer)")
    if cfg["vocab_size"] != spec.vocab_size:
        rep.fail("vocab_size_mismatch", f"{where}: vocab_size {cfg['vocab_size']} != verifier vocab_size "
                 f"{spec.vocab_size} ({spec.path})")
    if cfg["draft_vocab_size"] > cfg["vocab_size"]:
        rep.fail("draft_vocab_size_too_large", f"{where}: draft_vocab_size {cfg['draft_vocab_size']} > vocab_size "
                 f"{cfg['vocab_size']}")
    hidden = cfg["hidden_size"]
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is None:
        if hidden != spec.hidden_size:
            rep.fail("target_hidden_size_missing", f"{where}: target_hidden_size is absent, so vLLM sizes fc for "
                     f"hidden_size {hidden}, but the verifier's hidden size is {spec.hidden_size}")
        else:
            rep.warn("target_hidden_size_missing", f"{where}: target_hidden_size is absent (vLLM assumes "
                     f"hidden_size {hidden}, which matches the verifier)")
        target_hidden = hidden
    elif target_hidden != spec.hidden_size:
        rep.fail("target_hidden_size_mismatch", f"{where}: target_hidden_size {target_hidden} != verifier hidden "
                 f"size {spec.hidden_size} ({spec.path})")

    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv:
        rep.fail("config_bad_value", f"{where}: num_attention_heads {heads} is not a multiple of "
                 f"num_key_value_heads {kv}")
    if not _is_int(head_dim) or head_dim <= 0:
        rep.fail("config_bad_value", f"{where}: head_dim {head_dim!r} must be a positive integer")
        return None

    eagle_cfg = cfg.get("eagle_config")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    inner = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
    if top is None:
        rep.fail("aux_ids_missing_top_level", f"{where}: eagle_aux_hidden_state_layer_ids is missing at the top "
                 f"level; some vLLM versions read only that one and otherwise silently use the default layers "
                 f"(2, L//2, L-3)")
    if inner is None:
        rep.fail("aux_ids_missing_eagle_config", f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is "
                 f"missing; put the aux layer ids in eagle_config too")
    if top is not None and inner is not None and top != inner:
        rep.fail("aux_ids_mismatch", f"{where}: eagle_aux_hidden_state_layer_ids {top} (top level) != {inner} "
                 f"(eagle_config)")
    aux = top if top is not None else inner
    if isinstance(eagle_cfg, dict) and eagle_cfg.get("use_aux_hidden_state") is False:
        rep.fail("use_aux_hidden_state_false", f"{where}: eagle_config.use_aux_hidden_state is false: vLLM would "
                 f"feed the final state instead of fc(aux states)")
    n_aux = None
    if aux is not None:
        if not isinstance(aux, list) or not aux or not all(_is_int(k) for k in aux):
            rep.fail("aux_ids_invalid", f"{where}: eagle_aux_hidden_state_layer_ids {aux!r} must be a non-empty "
                     f"list of integers")
        else:
            n_aux = len(aux)
            out = [k for k in aux if not 0 <= k < spec.num_hidden_layers]
            if out:
                rep.fail("aux_ids_out_of_range", f"{where}: aux layer ids {out} out of range for the verifier's "
                         f"{spec.num_hidden_layers} layers (vLLM convention: id k = residual stream entering layer "
                         f"k, 0 <= k < {spec.num_hidden_layers})")
            if any(b <= a for a, b in itertools.pairwise(aux)):
                rep.fail("aux_ids_not_ascending", f"{where}: aux layer ids {aux} must be strictly ascending: vLLM "
                         f"concatenates the aux states in layer order whatever the config order, so fc would read "
                         f"them in another order than training")
    for opt in UNSUPPORTED_OPTIONS:
        if cfg.get(opt) or (isinstance(eagle_cfg, dict) and eagle_cfg.get(opt)):
            rep.fail("unsupported_option", f"{where}: {opt} is set; vLLM would apply it but eagle3.draft.model (training) "
                     f"does not, so serving would compute another draft")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        rep.fail("unsupported_option", f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r}; "
                 f"eagle3.draft.model implements default RoPE only")
    if _is_int(spec.text_config.get("max_position_embeddings")) and \
            cfg["max_position_embeddings"] < spec.text_config["max_position_embeddings"]:
        rep.warn("max_position_embeddings", f"{where}: max_position_embeddings {cfg['max_position_embeddings']} < "
                 f"the verifier's {spec.text_config['max_position_embeddings']}: vLLM caps max_model_len to it")
    return {"hidden": hidden, "target_hidden": target_hidden, "heads": heads, "kv": kv, "head_dim": head_dim,
            "inter": cfg["intermediate_size"], "vocab": cfg["vocab_size"], "draft_vocab": cfg["draft_vocab_size"],
            "target_vocab": spec.vocab_size,
            "n_aux": n_aux, "aux": aux, "torch_dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "")}


def expected_shapes(d: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape per the checkpoint contract, from the resolved config dimensions."""
    h, hd, i = d["hidden"], d["head_dim"], d["inter"]
    shapes: dict[str, tuple[int, ...]] = {
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (d["heads"] * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (d["kv"] * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (d["kv"] * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, d["heads"] * hd),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (d["draft_vocab"], h),
        "d2t": (d["draft_vocab"],),
        "t2d": (d["target_vocab"],),  # the verifier's vocab: a wrong config vocab_size is reported once, there
    }
    if d["n_aux"] is not None:
        shapes["fc.weight"] = (h, d["n_aux"] * d["target_hidden"])
    return shapes


def _check_weights(weights: Path, dims: dict[str, Any] | None, spec: VerifierSpec, rep: ValidationReport) -> None:
    try:
        f = safe_open(str(weights), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad header
        rep.fail("weights_unreadable", f"cannot read {weights}: {e}")
        return
    with f:
        raw_names = list(f.keys())
        header = {n: (_ST_DTYPES.get(f.get_slice(n).get_dtype(), f.get_slice(n).get_dtype()),
                      tuple(f.get_slice(n).get_shape())) for n in raw_names}
        prefixed = sorted(n for n in raw_names if n.startswith("model."))
        if prefixed:
            rep.fail("names_prefixed", f"{weights}: tensor names carry a 'model.' prefix ({', '.join(prefixed[:4])}"
                     f"{' ...' if len(prefixed) > 4 else ''}); vLLM's EAGLE-3 loader expects fc.weight, midlayer.*, "
                     f"norm.weight, lm_head.weight, d2t, t2d without it")
        # vLLM maps `midlayer.` onto `layers.0.`: both spellings load. Checks below use the contract's names.
        names: dict[str, str] = {}  # contract name -> name in the file
        for n in raw_names:
            c = n.removeprefix("model.")
            c = "midlayer." + c.removeprefix("layers.0.") if c.startswith("layers.0.") else c
            names[c] = n
        rep.summary["tensors"] = len(raw_names)
        rep.summary["embed_tokens_in_checkpoint"] = "embed_tokens.weight" in names
        if dims is None:
            return
        want = expected_shapes(dims)
        allowed = set(want) | {"embed_tokens.weight", "fc.weight"}
        if "d2t" not in names:
            rep.fail("d2t_missing", f"{weights}: no d2t tensor; vLLM then maps draft id i to target id i, wrong "
                     f"whenever the draft vocabulary ({dims['draft_vocab']}) is a subset of the target's "
                     f"({dims['vocab']})")
        if "t2d" not in names:
            rep.fail("t2d_missing", f"{weights}: no t2d tensor (target_vocab bool mask of the draft vocabulary)")
        missing = sorted(n for n in (set(want) | {"fc.weight"}) - {"d2t", "t2d"} if n not in names)
        if missing:
            rep.fail("tensors_missing", f"{weights}: missing {', '.join(missing)}")
        unexpected = sorted(n for n in names if n not in allowed)
        if unexpected:
            rep.fail("tensors_unexpected", f"{weights}: unexpected tensors {', '.join(unexpected)}")

        # config draft_vocab_size disagreeing with BOTH d2t and lm_head is one error (the config's), not three
        rows = {header[names[n]][1][0] for n in ("d2t", "lm_head.weight") if n in names and header[names[n]][1]}
        if len(rows) == 1 and dims["draft_vocab"] not in rows:
            rep.fail("draft_vocab_size_mismatch", f"{weights}: config draft_vocab_size is {dims['draft_vocab']} but "
                     f"d2t and lm_head.weight have {rows.pop()} rows (len(d2t) must equal draft_vocab_size)")
            want = {n: s for n, s in want.items() if n not in ("d2t", "lm_head.weight")}
        for name, shape in want.items():
            if name not in names:
                continue
            got = header[names[name]][1]
            if got == shape:
                continue
            if name == "fc.weight":
                rep.fail("fc_shape", f"{weights}: fc.weight has shape {got}, expected {shape} = [hidden_size "
                         f"{dims['hidden']}, n_aux {dims['n_aux']} * target_hidden_size {dims['target_hidden']}]")
            elif name == "lm_head.weight":
                rep.fail("lm_head_shape", f"{weights}: lm_head.weight has shape {got}, expected {shape} = "
                         f"[draft_vocab_size {dims['draft_vocab']}, hidden_size {dims['hidden']}]")
            elif name == "d2t":
                rep.fail("draft_vocab_size_mismatch", f"{weights}: d2t has shape {got} but config draft_vocab_size "
                         f"is {dims['draft_vocab']} (len(d2t) must equal draft_vocab_size)")
            elif name == "t2d":
                rep.fail("t2d_shape", f"{weights}: t2d has shape {got}, expected ({dims['target_vocab']},) = [verifier "
                     f"vocab_size]")
            else:
                rep.fail("shape_mismatch", f"{weights}: {name} has shape {got}, expected {shape} from config.json")
        if "embed_tokens.weight" in names:
            got = header[names["embed_tokens.weight"]][1]
            if got != (dims["vocab"], dims["hidden"]):
                rep.fail("shape_mismatch", f"{weights}: embed_tokens.weight has shape {got}, expected "
                         f"({dims['vocab']}, {dims['hidden']}) = [vocab_size, hidden_size]")
        elif dims["hidden"] != spec.hidden_size:
            rep.fail("embed_shared_hidden_mismatch", f"{weights}: embed_tokens.weight is absent, so vLLM shares the "
                     f"verifier's embedding, which has width {spec.hidden_size}, not the draft hidden_size "
                     f"{dims['hidden']}: include embed_tokens.weight or make the widths equal")

        floats = {n: header[names[n]][0] for n in names if n not in ("d2t", "t2d")}
        not_float = sorted(n for n, dt in floats.items() if dt not in _FLOAT_DTYPES)
        if not_float:
            rep.fail("dtype_mismatch", f"{weights}: weights must be floating point: "
                     f"{', '.join(f'{n} ({floats[n]})' for n in not_float)}")
        kinds = sorted({dt for dt in floats.values() if dt in _FLOAT_DTYPES})
        declared = dims["torch_dtype"].replace("torch.", "")
        if len(kinds) > 1:
            rep.fail("dtype_mismatch", f"{weights}: weights mix dtypes {kinds}")
        elif kinds and declared and declared != "auto" and kinds[0] != declared:
            rep.fail("dtype_mismatch", f"{weights}: weights are {kinds[0]} but config torch_dtype is {declared}")
        rep.summary["dtype"] = kinds[0] if len(kinds) == 1 else kinds
        rep.summary["num_parameters"] = sum(math.prod(header[names[n]][1]) for n in floats)

        _check_vocab_tables(f, names, header, dims, weights, rep)
        bad = []
        for n in sorted(floats):
            if floats[n] not in _FLOAT_DTYPES:
                continue
            sl = f.get_slice(names[n])
            rows = header[names[n]][1][0] if header[names[n]][1] else 1
            count = 0
            for start in range(0, max(rows, 1), _NONFINITE_CHUNK_ROWS):
                t = sl[start:start + _NONFINITE_CHUNK_ROWS] if header[names[n]][1] else f.get_tensor(names[n])
                count += int((~torch.isfinite(t)).sum())
            if count:
                bad.append(f"{n} ({count} values)")
        if bad:
            rep.fail("nonfinite", f"{weights}: NaN/Inf in {', '.join(bad)}")


def _check_vocab_tables(f, names: dict[str, str], header: dict, dims: dict[str, Any], weights: Path,
                        rep: ValidationReport) -> None:
    """d2t (offset table, int64) and t2d (bool mask) against each other and the vocab sizes."""
    targets = None
    if "d2t" in names:
        dt, shape = header[names["d2t"]]
        if dt != "int64":
            rep.fail("d2t_dtype", f"{weights}: d2t is {dt}, expected int64 (vLLM adds it to draft ids)")
        elif len(shape) == 1:
            d2t = f.get_tensor(names["d2t"])
            targets = torch.arange(len(d2t)) + d2t  # [draft_vocab] target ids
            out = torch.nonzero((targets < 0) | (targets >= dims["target_vocab"])).flatten()
            if len(out):
                i = int(out[0])
                rep.fail("d2t_out_of_range", f"{weights}: d2t maps {len(out)} draft ids outside the target vocab "
                         f"[0, {dims['target_vocab']}), first: draft id {i} -> {int(targets[i])} (target = id + d2t[id])")
                targets = None
            elif len(torch.unique(targets)) != len(targets):
                rep.fail("d2t_not_unique", f"{weights}: d2t maps several draft ids onto the same target id "
                         f"({len(targets) - len(torch.unique(targets))} duplicates)")
                targets = None
    if "t2d" in names:
        dt, shape = header[names["t2d"]]
        if dt != "bool":
            rep.fail("t2d_dtype", f"{weights}: t2d is {dt}, expected bool")
        elif targets is not None and shape == (dims["target_vocab"],):
            t2d = f.get_tensor(names["t2d"])
            expect = torch.zeros_like(t2d)
            expect[targets] = True
            diff = torch.nonzero(t2d != expect).flatten()
            if len(diff):
                i = int(diff[0])
                rep.fail("t2d_inconsistent", f"{weights}: t2d is not true exactly at arange(draft_vocab) + d2t: "
                         f"{int(t2d.sum())} true entries vs {len(targets)} draft ids, {len(diff)} target ids "
                         f"differ (first: {i}, t2d={bool(t2d[i])})")


def validate_checkpoint(draft_dir: str | os.PathLike, verifier_path: str | os.PathLike) -> ValidationReport:
    """Check a draft folder against the vLLM checkpoint contract and the verifier. Never raises on bad input:
    every problem becomes a ``Finding`` in the report (``report.ok`` is False when any failure was found)."""
    draft_dir, verifier_path = Path(draft_dir), Path(verifier_path)
    rep = ValidationReport(str(draft_dir), str(verifier_path))
    try:
        spec = VerifierSpec.from_path(verifier_path)
    except VerifierError as e:
        rep.fail("verifier_unreadable", str(e))
        return rep
    if not draft_dir.is_dir():
        rep.fail("draft_dir_missing", f"draft checkpoint folder not found: {draft_dir}")
        return rep
    cfg_file = draft_dir / CONFIG
    dims = None
    if not cfg_file.is_file():
        rep.fail("config_missing", f"draft config not found: {cfg_file}")
    else:
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            rep.fail("config_invalid_json", f"{cfg_file} is not valid JSON: {e}")
        else:
            if not isinstance(cfg, dict):
                rep.fail("config_invalid_json", f"{cfg_file} holds a {type(cfg).__name__}, not a JSON object")
            else:
                dims = _check_config(cfg, spec, rep, str(cfg_file))
    if dims is not None:
        rep.summary.update(hidden_size=dims["hidden"], target_hidden_size=dims["target_hidden"],
                           vocab_size=dims["vocab"], draft_vocab_size=dims["draft_vocab"],
                           aux_layer_ids=dims["aux"], head_dim=dims["head_dim"])
    rep.summary.update(verifier_hidden_size=spec.hidden_size, verifier_layers=spec.num_hidden_layers,
                       verifier_vocab_size=spec.vocab_size)
    weights = draft_dir / WEIGHTS
    if not weights.is_file():
        rep.fail("weights_missing", f"draft weights not found: {weights} (one safetensors file, names without "
                 f"'model.' prefix)")
    else:
        _check_weights(weights, dims, spec, rep)
    if not (draft_dir / RUN_INFO).is_file():
        rep.warn("run_info_missing", f"{draft_dir / RUN_INFO} is missing (run config, versions, git revision)")
    return rep


# ----------------------------------------------------------------------------- 2. vLLM check


def run_vllm_check(cfg: ValidateConfig, verifier_path: str | os.PathLike, draft_dirs: list[str | os.PathLike],
                   prompts_path: str | os.PathLike, work_dir: str | os.PathLike) -> dict[str, Any]:
    """Run eagle3.validate.vllm_check in the vLLM interpreter for each draft (one subprocess, one baseline run).

    Returns its result (see eagle3.validate.vllm_check.run_check). Raises ``eagle3.support.subproc.SubprocessFailed`` when the
    subprocess fails or times out (its process group is killed), FileNotFoundError when there is no vLLM interpreter.
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / "vllm_result.json"
    out.unlink(missing_ok=True)
    args = {
        "verifier": str(Path(verifier_path).resolve()), "drafts": [str(Path(d).resolve()) for d in draft_dirs],
        "prompts_path": str(Path(resolve_path(prompts_path)).resolve()), "num_prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens, "num_speculative_tokens": cfg.num_speculative_tokens,
        "tensor_parallel_size": cfg.tensor_parallel_size, "dtype": cfg.dtype, "max_model_len": cfg.max_model_len,
        "gpu_memory_utilization": cfg.gpu_memory_utilization, "enforce_eager": cfg.enforce_eager,
        "trust_remote_code": cfg.trust_remote_code, "seed": 0, "out": str(out),
    }
    args_file = atomic_write_json(work_dir / "vllm_args.json", args)
    env = vllm_subprocess_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if cfg.engine_in_process else None)
    cmd = [vllm_python(cfg.vllm_python), "-m", "eagle3.validate.vllm_check", "--args-json", str(args_file)]
    log.info("[validate] vLLM check: %s", " ".join(cmd))
    run_subprocess(cmd, env=env, timeout_s=cfg.timeout_s, log_prefix="[vllm] ", cwd=REPO_ROOT).check()
    return json.loads(out.read_text())


def make_untrained_draft(draft_dir: str | os.PathLike, verifier_path: str | os.PathLike,
                         out: str | os.PathLike, seed: int = 0) -> Path:
    """The draft before training: ``draft_dir``'s config and d2t/t2d, ``Eagle3Draft.from_verifier`` init (the
    trainer's step 0: verifier embedding, lm_head rows and final norm, seeded random layer), saved as a checkpoint."""
    from safetensors.torch import load_file

    from eagle3.draft.checkpoint import read_config, save_draft
    from eagle3.draft.model import Eagle3Draft

    cfg = read_config(draft_dir)
    tables = load_file(str(Path(draft_dir) / WEIGHTS))
    draft = Eagle3Draft.from_verifier(cfg, verifier_path, tables["d2t"], tables["t2d"], seed=seed)
    return save_draft(out, cfg, draft.state_dict(), {"verifier": str(verifier_path), "untrained": True,
                                                      "trained_from": str(draft_dir), "seed": seed})


# ----------------------------------------------------------------------------- 3 + 4. verdict and report


def _relative_difference(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


def validate_draft(cfg: ValidateConfig, draft_dir: str | os.PathLike, verifier_path: str | os.PathLike,
                   prompts_path: str | os.PathLike | None, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Structural check -> vLLM check -> offline parity (if enabled) -> verdict -> report files in ``out_dir``.

    Returns the report dict (also in ``out_dir/report.json``): ``verdict`` "pass" | "fail", ``reasons``,
    ``structural``, ``vllm`` (acceptance, lossless, timings), ``offline`` and ``paths``.
    """
    out_dir = Path(out_dir)
    prompts_path = Path(resolve_path(prompts_path or cfg.prompts_path))
    reasons: list[str] = []
    report: dict[str, Any] = {"format": "eagle3-validation/1", "draft_dir": str(draft_dir),
                              "verifier_path": str(verifier_path), "prompts_path": str(prompts_path),
                              "settings": cfg.model_dump(mode="json")}
    structural = validate_checkpoint(draft_dir, verifier_path)
    report["structural"] = structural.to_dict()
    for f in structural.failures:
        reasons.append(f"[{f.code}] {f.message}")
    for f in structural.warnings:
        log.warning("[validate] %s: %s", f.code, f.message)
    if structural.ok and (Path(draft_dir) / WEIGHTS).is_file():
        report["weights_sha256"] = sha256_file(Path(draft_dir) / WEIGHTS)

    vllm_acc = None
    if not cfg.run_vllm:
        report["vllm"] = {"skipped": "run_vllm is false"}
    elif not structural.ok:
        report["vllm"] = {"skipped": "the checkpoint failed the structural check"}
    else:
        # bad settings are errors, not verdicts: no vLLM interpreter, an unusable prompts file
        vllm_python(cfg.vllm_python)
        read_prompt_messages(prompts_path, cfg.num_prompts)
        drafts = [draft_dir]
        if cfg.compare_untrained:
            drafts.append(make_untrained_draft(draft_dir, verifier_path, out_dir / "untrained-draft"))
        try:
            result = run_vllm_check(cfg, verifier_path, drafts, prompts_path, out_dir / "vllm")
        except SubprocessFailed as e:  # a draft vLLM cannot load (or run in time) is a verdict, not a crash
            reasons.append(f"[vllm_failed] {e}")
            report["vllm"] = {"error": str(e)}
        else:
            d = result["drafts"][0]
            vllm_acc = d["acceptance"]
            report["vllm"] = {
                "vllm_version": result["vllm_version"], "acceptance": vllm_acc, "lossless": d["lossless"],
                "mismatches": d["mismatches"], "engine_start_seconds": d["engine_start_seconds"],
                "generate_seconds": d["generate_seconds"], "generated_tokens": d["generated_tokens"],
                "baseline_generate_seconds": result["baseline"]["generate_seconds"],
                "num_prompts": len(result["prompt_token_ids"]), "samples": [
                    {"prompt": i, "text": t[:300]} for i, t in enumerate(d["texts"][:3])],
            }
            if cfg.compare_untrained:
                u = result["drafts"][1]
                report["vllm"]["untrained"] = {"draft_dir": str(drafts[1]), "acceptance": u["acceptance"],
                                               "lossless": u["lossless"]}
                gain = vllm_acc["mean_acceptance_length"] - u["acceptance"]["mean_acceptance_length"]
                report["vllm"]["gain_over_untrained"] = gain
                if not gain > 0:
                    reasons.append(f"[no_gain] trained draft's mean acceptance length "
                                   f"{vllm_acc['mean_acceptance_length']:.3f} is not above the untrained draft's "
                                   f"{u['acceptance']['mean_acceptance_length']:.3f}")
            if vllm_acc["num_drafts"] == 0:
                reasons.append("[no_drafts] vLLM ran no speculative steps (no spec-decode metrics)")
            if cfg.require_lossless and not d["lossless"]:
                m = d["mismatches"][0] if d["mismatches"] else {}
                reasons.append(f"[not_lossless] speculative and plain greedy outputs differ on "
                               f"{len(d['mismatches'])} of {len(d['token_ids'])} prompts (first: prompt "
                               f"{m.get('prompt')} at token {m.get('first_difference_at_token')})")
            mal = vllm_acc["mean_acceptance_length"]
            if cfg.min_mean_acceptance_length is not None and not mal >= cfg.min_mean_acceptance_length:
                reasons.append(f"[below_threshold] vLLM mean acceptance length {mal:.3f} < "
                               f"min_mean_acceptance_length {cfg.min_mean_acceptance_length}")

    if cfg.offline_reference and structural.ok:
        from eagle3.validate.specdec import offline_acceptance

        off = offline_acceptance(verifier_path, draft_dir, prompts_path, cfg.num_prompts, cfg.num_speculative_tokens,
                                 cfg.max_new_tokens, cfg.trust_remote_code)
        report["offline"] = {"acceptance": off.acceptance.to_dict(), "seconds": off.seconds}
        if vllm_acc is not None:
            rel = _relative_difference(off.acceptance.mean_acceptance_length, vllm_acc["mean_acceptance_length"])
            report["offline"]["relative_difference"] = rel
            if not rel <= cfg.parity_tolerance:
                reasons.append(f"[parity] offline mean acceptance length {off.acceptance.mean_acceptance_length:.3f}"
                               f" vs vLLM {vllm_acc['mean_acceptance_length']:.3f}: {rel:.1%} apart (> "
                               f"{cfg.parity_tolerance:.0%})")

    report["verdict"] = "fail" if reasons else "pass"
    report["reasons"] = reasons
    report["paths"] = write_report(out_dir, report)
    log.info("[validate] verdict %s%s", report["verdict"], "".join(f"\n  - {r}" for r in reasons))
    return report


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def render_markdown(report: dict[str, Any]) -> str:
    s = report.get("structural", {})
    lines = [f"# EAGLE-3 draft validation: **{report['verdict'].upper()}**", "",
             f"- draft: `{report['draft_dir']}`", f"- verifier: `{report['verifier_path']}`",
             f"- prompts: `{report.get('prompts_path')}`", ""]
    if report["reasons"]:
        lines += ["## Reasons", ""] + [f"- {r}" for r in report["reasons"]] + [""]
    lines += ["## Checkpoint contract", "", "| check | result |", "|---|---|",
              f"| structural | {'ok' if s.get('ok') else 'FAILED (' + str(len(s.get('failures', []))) + ')'} |"]
    for key in ("aux_layer_ids", "hidden_size", "vocab_size", "draft_vocab_size", "dtype", "num_parameters",
                "embed_tokens_in_checkpoint"):
        if key in s.get("summary", {}):
            lines.append(f"| {key} | {s['summary'][key]} |")
    for f in s.get("failures", []):
        lines.append(f"| `{f['code']}` | {f['message'].replace('|', '/')} |")
    for f in s.get("warnings", []):
        lines.append(f"| warning `{f['code']}` | {f['message'].replace('|', '/')} |")
    lines.append("")
    v = report.get("vllm", {})
    acc = v.get("acceptance")
    off = (report.get("offline") or {}).get("acceptance")
    unt = (v.get("untrained") or {}).get("acceptance")
    if acc:
        st = report["settings"]
        cols = [("vLLM", acc)] + ([("vLLM, untrained draft", unt)] if unt else []) + (
            [("offline reference", off)] if off else [])
        lines += ["## Speculative decoding", "",
                  (f"{v.get('num_prompts')} prompts, {st['max_new_tokens']} new tokens max, "
                   f"{st['num_speculative_tokens']} speculative tokens, temperature 0, vLLM {v.get('vllm_version')}."),
                  "", "| figure | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]

        def row(name: str, get) -> str:
            return f"| {name} | " + " | ".join(_fmt(get(a)) for _, a in cols) + " |"

        lines.append(row("mean acceptance length", lambda a: a["mean_acceptance_length"]))
        for i in range(len(acc["per_position_acceptance"])):
            lines.append(row(f"acceptance at position {i + 1}", lambda a, i=i: a["per_position_acceptance"][i]))
        lines.append(row("drafts (verifier steps)", lambda a: a["num_drafts"]))
        lines.append(row("accepted / draft tokens",
                         lambda a: f"{a['num_accepted_tokens']} / {a['num_draft_tokens']}"))
        lossless = "yes" if v.get("lossless") else "NO"
        lines += ["", f"- lossless (speculative output identical to plain greedy): {lossless}"]
        if off:
            lines.append(f"- offline vs vLLM mean acceptance length: "
                         f"{_fmt(report['offline'].get('relative_difference'))} relative difference")
        lines += ["", "![per-position acceptance](acceptance.png)", ""]
    elif v:
        lines += ["## Speculative decoding", "", f"not run: {v.get('skipped') or v.get('error', '')[:2000]}", ""]
    return "\n".join(lines)


def write_report(out_dir: str | os.PathLike, report: dict[str, Any]) -> dict[str, str]:
    """report.json + report.md + acceptance.png (when vLLM measured acceptance) in ``out_dir``; returns the paths."""
    from eagle3.support.plot import bar_chart

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report_json": str(out_dir / "report.json"), "report_md": str(out_dir / "report.md")}
    acc = (report.get("vllm") or {}).get("acceptance")
    if acc:
        k = len(acc["per_position_acceptance"])
        bar_chart(out_dir / "acceptance.png", [f"pos {i + 1}" for i in range(k)],
                  [float(r) for r in acc["per_position_acceptance"]],
                  title=f"vLLM acceptance per draft position (mean length {_fmt(acc['mean_acceptance_length'], 2)})",
                  ylabel="acceptance rate")
        paths["acceptance_png"] = str(out_dir / "acceptance.png")
    report = {**report, "paths": paths}
    atomic_write_text(out_dir / "report.md", render_markdown(report) + "\n")
    atomic_write_json(out_dir / "report.json", report)
    return paths

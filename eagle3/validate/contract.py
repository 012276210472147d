"""The vLLM checkpoint contract, checked on the files: config.json and the safetensors header (then each float
tensor once, for NaN/Inf), against the verifier and ../shared/EAGLE3_FACTS.md.

Every failure is one ``Finding`` with a stable ``code`` and a message that names the field or tensor; the report
lists them all. File names, architecture names and the unsupported options come from eagle3.draft (their one
owner); the expected tensor shapes are read off the draft model itself (``eagle3.draft.checkpoint.expected_shapes``).
Layer ids: vLLM's convention, id k = residual stream ENTERING decoder layer k.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.draft.checkpoint import CONFIG, RUN_INFO, WEIGHTS, expected_shapes
from eagle3.draft.config import (
    ARCHITECTURES,
    MLA_WIDTHS,
    MODEL_TYPES,
    ROPE_TYPES,
    UNSUPPORTED_OPTIONS,
    DraftConfig,
    DraftConfigError,
    kind_of_architecture,
    serving_pair_problem,
)
from eagle3.support.dtypes import DTYPES, DTypeError, from_safetensors
from eagle3.support.verifier import VerifierError, VerifierSpec, aux_layer_problems

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "num_hidden_layers", "vocab_size", "draft_vocab_size", "rms_norm_eps", "max_position_embeddings")
FLOAT_DTYPES = {d.name for d in DTYPES.values() if d.floating}
_NONFINITE_CHUNK_ROWS = 4096  # rows per isfinite() slice, so a 163840-row embedding never doubles in memory

# ----------------------------------------------------------------------------- 1. structural validation


@dataclass
class Finding:
    code: str  # stable identifier, e.g. "aux_ids_out_of_range"
    message: str  # names the file, field or tensor, and what was expected


@dataclass
class ContractReport:
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


def _check_config(cfg: dict, spec: VerifierSpec, rep: ContractReport, where: str) -> dict[str, Any] | None:
    """Config checks; returns the resolved dimensions the weight checks need (None when the config is unusable)."""
    nested = [k for k in ("text_config", "transformer_layer_config", "llm_config") if isinstance(cfg.get(k), dict)]
    if nested or ("hidden_size" not in cfg and any(isinstance(v, dict) and "hidden_size" in v for v in cfg.values())):
        key = nested[0] if nested else next(k for k, v in cfg.items() if isinstance(v, dict) and "hidden_size" in v)
        rep.fail("config_nested", f"{where} is nested (the draft's fields are under {key!r}); vLLM's "
                 f"EAGLE-3 drafts read a FLAT config: hidden_size, vocab_size, draft_vocab_size, ... and "
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
    kind = kind_of_architecture(archs)
    if kind is None:
        names = " or ".join(f"[{n!r}]" for names in ARCHITECTURES.values() for n in names)
        rep.fail("architectures", f"{where}: architectures is {archs!r}; vLLM maps this project's EAGLE-3 drafts "
                 f"from {names}")
        kind = "llama"
    if cfg.get("model_type") != MODEL_TYPES[kind]:
        why = (": vLLM's speculative config turns a deepseek_v3 draft config into DeepSeek's MTP module"
               if cfg.get("model_type") == "deepseek_v3" else "")
        rep.fail("model_type", f"{where}: model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPES[kind]!r} for "
                 f"a {kind} draft{why}")
    if problem := serving_pair_problem(spec.mla, kind, "cuda" if torch.cuda.is_available() else "cpu"):
        rep.fail("serving_pair_unsupported", f"{where}: {problem}")
    mla = {k: cfg.get(k) for k in MLA_WIDTHS} if kind == "mla" else {}
    bad_widths = [k for k, v in mla.items() if v is not None and (not _is_int(v) or v <= 0)]
    if bad_widths or (kind == "mla" and any(mla[k] is None for k in MLA_WIDTHS if k != "q_lora_rank")):
        rep.fail("config_bad_value", f"{where}: an MLA draft needs positive integers {', '.join(MLA_WIDTHS)} "
                 f"(q_lora_rank may be null); got {mla}")
        return None
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
    head_dim = cfg.get("head_dim") or (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla else hidden // heads)
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
        if not isinstance(aux, list) or not all(_is_int(k) for k in aux):
            rep.fail("aux_ids_invalid", f"{where}: eagle_aux_hidden_state_layer_ids {aux!r} must be a list of "
                     f"integers")
        else:
            n_aux = len(aux) or None
            for code, message in aux_layer_problems(aux, spec.num_hidden_layers, "eagle_aux_hidden_state_layer_ids"):
                rep.fail(code, f"{where}: {message}")
    for opt in UNSUPPORTED_OPTIONS:
        if cfg.get(opt) or (isinstance(eagle_cfg, dict) and eagle_cfg.get(opt)):
            rep.fail("unsupported_option", f"{where}: {opt} is set; vLLM would apply it but eagle3.draft.model (training) "
                     f"does not, so serving would compute another draft")
    # vLLM reads norm_before_fc from eagle_config first, then the top level
    norm_before_fc = bool((eagle_cfg if isinstance(eagle_cfg, dict) else {}).get("norm_before_fc",
                                                                              cfg.get("norm_before_fc", False)))
    if norm_before_fc and kind == "mla":
        rep.fail("unsupported_option", f"{where}: norm_before_fc is set on an MLA draft; vLLM's deepseek_eagle3 has no "
                 f"input norm (it would not load input_norm.weight): use fc_norm")
    if "norm_before_residual" not in cfg:
        rep.warn("norm_before_residual_missing", f"{where}: norm_before_residual is absent; vLLM's speculators path "
                 f"reads a missing value as true, speculators' own default is false: write it out")
    rope = cfg.get("rope_scaling") or (cfg.get("rope_parameters") if kind == "llama" else None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ROPE_TYPES[kind]:
        rep.fail("unsupported_option", f"{where}: rope type {rope_type!r}; eagle3.draft computes "
                 f"{', '.join(ROPE_TYPES[kind])} RoPE for a {kind} draft")
    if _is_int(spec.text_config.get("max_position_embeddings")) and \
            cfg["max_position_embeddings"] < spec.text_config["max_position_embeddings"]:
        rep.warn("max_position_embeddings", f"{where}: max_position_embeddings {cfg['max_position_embeddings']} < "
                 f"the verifier's {spec.text_config['max_position_embeddings']}: vLLM caps max_model_len to it")
    return {"kind": kind, "mla": mla, "rope_scaling": rope if kind == "mla" and rope else None,
            "norm_before_fc": norm_before_fc and kind == "llama", "fc_norm": bool(cfg.get("fc_norm", False)),
            "hidden": hidden, "target_hidden": target_hidden, "heads": heads, "kv": kv, "head_dim": head_dim,
            "inter": cfg["intermediate_size"], "vocab": cfg["vocab_size"], "draft_vocab": cfg["draft_vocab_size"],
            "target_vocab": spec.vocab_size,
            "n_aux": n_aux, "aux": aux, "torch_dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "")}


def _expected(d: dict[str, Any], rep: ContractReport, where: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape for the resolved config dimensions, read off the draft model itself (embed_tokens left
    out: a checkpoint may omit it; fc left out when the aux ids are unusable). None when no model can be built."""
    try:
        cfg = DraftConfig(
            kind=d["kind"], **d["mla"], rope_scaling=d["rope_scaling"], norm_before_fc=d["norm_before_fc"],
            fc_norm=d["fc_norm"],
            hidden_size=d["hidden"], target_hidden_size=d["target_hidden"], intermediate_size=d["inter"],
            num_attention_heads=d["heads"], num_key_value_heads=d["kv"], head_dim=d["head_dim"],
            vocab_size=d["target_vocab"],  # t2d covers the verifier's vocab (a wrong config vocab is reported once)
            draft_vocab_size=min(d["draft_vocab"], d["target_vocab"]), aux_layer_ids=list(range(d["n_aux"] or 1)))
    except (DraftConfigError, ValueError) as e:
        if rep.ok:
            rep.fail("config_bad_value", f"{where}: {e}")
        return None
    shapes = expected_shapes(cfg)
    shapes.pop("embed_tokens.weight")
    if d["n_aux"] is None:
        shapes.pop("fc.weight")
        shapes = {n: s for n, s in shapes.items() if not n.startswith(("input_norm.", "fc_norm."))}
    return shapes


def _dtype_name(code: str) -> str:
    try:
        return from_safetensors(code).name
    except DTypeError:
        return code


def _check_weights(weights: Path, dims: dict[str, Any] | None, spec: VerifierSpec, rep: ContractReport) -> None:
    try:
        f = safe_open(str(weights), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad header
        rep.fail("weights_unreadable", f"cannot read {weights}: {e}")
        return
    with f:
        raw_names = list(f.keys())
        header = {n: (_dtype_name(f.get_slice(n).get_dtype()),
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
        want = _expected(dims, rep, str(weights))
        if want is None:
            return
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
        not_float = sorted(n for n, dt in floats.items() if dt not in FLOAT_DTYPES)
        if not_float:
            rep.fail("dtype_mismatch", f"{weights}: weights must be floating point: "
                     f"{', '.join(f'{n} ({floats[n]})' for n in not_float)}")
        kinds = sorted({dt for dt in floats.values() if dt in FLOAT_DTYPES})
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
            if floats[n] not in FLOAT_DTYPES:
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
                        rep: ContractReport) -> None:
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


def validate_checkpoint(draft_dir: str | os.PathLike, verifier_path: str | os.PathLike) -> ContractReport:
    """Check a draft folder against the vLLM checkpoint contract and the verifier. Never raises on bad input:
    every problem becomes a ``Finding`` in the report (``report.ok`` is False when any failure was found)."""
    draft_dir, verifier_path = Path(draft_dir), Path(verifier_path)
    rep = ContractReport(str(draft_dir), str(verifier_path))
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

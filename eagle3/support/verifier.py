"""What the pipeline needs to know about a verifier without loading it; the owner of the verifier's identity.

* ``VerifierSpec.from_path`` reads ``config.json`` alone (nested ``text_config`` as in Kimi-K2.5, whose language
  model is a DeepseekV3 model under the ``language_model.`` prefix).
* ``verifier_fingerprint`` is THE recipe of a verifier's content identity (cache keys, the store's ``store.json``,
  training's store check); ``describe_verifier`` wraps it with the path as a ``VerifierIdentity``.
* ``aux_layer_problems`` is THE rule for aux layer ids (not empty, in range, ascending); ``resolve_aux_layer_ids``
  adds vLLM's default when unset and raises the rule's first problem: capacity planning, extraction and the draft
  config all call it, and the vLLM contract check reports the rule's problems of a checkpoint's config.
* ``teacher_logits`` is THE teacher head (final RMSNorm + lm_head rows on the stored pre-norm final state).
* ``find_tensor_names`` / ``load_verifier_head`` open only the safetensors shards that hold the embedding, the
  final norm and ``lm_head`` (through ``model.safetensors.index.json``), matching names by suffix so nested
  prefixes work, and read only the ``lm_head`` rows of the draft vocabulary.

Layer ids follow vLLM's convention: id k = residual stream ENTERING decoder layer k (HF hidden_states[k]).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open

from eagle3.support.io import sha256_file

# weights up to this many bytes in total are hashed in full (the bundled and SmolLM2 verifiers: seconds); beyond,
# each shard's safetensors header (names, dtypes, shapes, offsets) and size stand for it (Kimi-K2.5: 547 GB)
FULL_HASH_MAX_BYTES = 2 << 30
_IDENTITY_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
_TOKENIZER_GLOBS = ("tokenizer*", "*.jinja", "special_tokens*", "chat_template*", "*.tiktoken", "*.model")


# text-model types that checkpoints name but transformers does not register: Kimi-K2 / K2.5 ship their DeepseekV3
# language model as "kimi_k2" (transformers' own Kimi_K25Config and vLLM's config registry map it the same way)
TEXT_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
MLA_KEY = "kv_lora_rank"  # a text config with it is a DeepSeek-style multi-head latent attention model


class VerifierError(ValueError):
    """A verifier path, config or weight file is not usable; the message names the file."""


@dataclass(frozen=True)
class VerifierSpec:
    path: Path
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    dtype: str  # "bfloat16" | "float16" | "float32": the checkpoint's own dtype
    tie_word_embeddings: bool
    text_config: dict  # the (possibly nested) language-model config, as read
    nested: bool  # True when config.json wraps the language model in `text_config`

    @classmethod
    def from_path(cls, path: str | Path) -> VerifierSpec:
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.exists():
            raise VerifierError(f"verifier not found: {path} does not exist (verifier_path: a Hugging Face model "
                                f"folder with config.json and safetensors weights)")
        if not path.is_dir():
            raise VerifierError(f"verifier path {path} is not a folder (expected a Hugging Face model folder)")
        if not cfg_file.is_file():
            raise VerifierError(f"verifier config not found: {cfg_file}")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise VerifierError(f"verifier config {cfg_file} is not valid JSON: {e}") from None
        text = cfg.get("text_config") or cfg
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text]
        if missing:
            raise VerifierError(f"verifier config {cfg_file} lacks {', '.join(missing)}")
        dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        try:
            return cls._from_config(path, cfg, text, dtype)
        except (TypeError, ValueError) as e:
            raise VerifierError(f"verifier config {cfg_file}: a size field is not a number ({e})") from None

    @classmethod
    def _from_config(cls, path: Path, cfg: dict, text: dict, dtype: str) -> VerifierSpec:
        return cls(
            path=path,
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            vocab_size=int(text["vocab_size"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            dtype=dtype.replace("torch.", ""),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            text_config=text,
            nested="text_config" in cfg,
        )

    @property
    def mla(self) -> bool:
        """True for a multi-head latent attention language model (DeepseekV3, Kimi-K2 / K2.5)."""
        return MLA_KEY in self.text_config

    def transformers_text_config(self) -> dict:
        """The language model's config as transformers' ``AutoConfig.for_model`` takes it (model-type aliases
        resolved: Kimi's "kimi_k2" is transformers' "deepseek_v3")."""
        model_type = self.text_config.get("model_type")
        if not model_type:
            raise VerifierError(f"{self.path}/config.json: the language model's config has no model_type")
        return {**self.text_config, "model_type": TEXT_MODEL_TYPE_ALIASES.get(model_type, model_type)}

    def resolve_aux_layer_ids(self, ids: list[int] | None) -> list[int]:
        """Aux layer ids in vLLM's convention (id k = residual stream ENTERING decoder layer k), defaulted and checked.

        None = vLLM's default (2, L//2, L-3), deduplicated and ascending as vLLM uses them (Kimi-K2.5, L=61:
        [2, 30, 58]; a 4-layer verifier: [1, 2]). Given ids must be in 0 <= k < L and strictly increasing: vLLM
        concatenates aux states in ascending layer order, so the stored order must be that order too.
        """
        n = self.num_hidden_layers
        ids = sorted({2, n // 2, n - 3} & set(range(n))) if ids is None else [int(k) for k in ids]
        for _, message in aux_layer_problems(ids, n, "aux_layer_ids"):
            raise VerifierError(f"{message}; verifier {self.path}")
        return ids


def aux_layer_problems(ids: list[int], num_layers: int, name: str) -> list[tuple[str, str]]:
    """The rule for aux layer ids, in one place: (code, message) per broken part of it, none when ``ids`` (integers,
    vLLM's convention) suit a verifier of ``num_layers`` decoder layers. ``name`` is the field the message names.
    Used by the stages (``resolve_aux_layer_ids`` raises the first) and by the vLLM contract check (reports all)."""
    if not ids:
        return [("aux_ids_empty", f"{name} is empty: EAGLE-3 needs at least one auxiliary layer")]
    problems = []
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        message = (f"{name} {bad} out of range for a verifier with {num_layers} layers (vLLM convention: id k = "
                   f"residual stream entering layer k, 0 <= k < {num_layers})")
        problems.append(("aux_ids_out_of_range", message))
    if any(b <= a for a, b in itertools.pairwise(ids)):
        message = (f"{name} {ids} must be strictly increasing: vLLM concatenates the aux states in ascending layer "
                   f"order whatever the order given, so they are stored, trained and served in that order")
        problems.append(("aux_ids_not_ascending", message))
    return problems


def verifier_fingerprint(path: str | Path) -> str:
    """Content identity of a verifier: config.json, generation_config.json, the weight index, the tokenizer and chat
    template files, and the weights: hashed in full up to ``FULL_HASH_MAX_BYTES`` in total, else each shard's
    safetensors header + size (never reading 547 GB). Independent of where the folder lies."""
    root = Path(path)
    if not (root / "config.json").is_file():
        VerifierSpec.from_path(root)  # the clear error: not found / not a folder / no config.json
    h = hashlib.sha256()
    for name in _IDENTITY_FILES:
        if (root / name).is_file():
            h.update(name.encode() + sha256_file(root / name).encode())
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise VerifierError(f"no safetensors weights in {root} (expected model.safetensors or shards + index)")
    full = sum(f.stat().st_size for f in shards) <= FULL_HASH_MAX_BYTES
    for shard in shards:
        h.update(shard.name.encode() + str(shard.stat().st_size).encode())
        if full:
            h.update(sha256_file(shard).encode())
        else:
            with open(shard, "rb") as f:  # the header lists every tensor's name, dtype, shape and byte range
                n = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(n, 100 << 20)))
    h.update(tokenizer_fingerprint(root).encode())
    return h.hexdigest()


def tokenizer_fingerprint(path: str | Path) -> str:
    """Content identity of a tokenizer folder: its tokenizer and chat-template files (never the weights beside
    them). Part of ``verifier_fingerprint``; the prepare stage keys on it alone."""
    root = Path(path)
    h = hashlib.sha256()
    for tok in sorted({f for g in _TOKENIZER_GLOBS for f in root.glob(g) if f.is_file()}):
        h.update(tok.name.encode() + sha256_file(tok).encode())
    return h.hexdigest()


class VerifierIdentity(BaseModel):
    """Which verifier a stage ran against: its folder and content fingerprint (cache keys use the fingerprint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="The verifier's folder (absolute).")
    fingerprint: str = Field(description="verifier_fingerprint of the folder's content.")

    def spec(self) -> VerifierSpec:
        return VerifierSpec.from_path(self.path)


def describe_verifier(path: str | Path) -> VerifierIdentity:
    """The identity of the verifier at ``path``; raises VerifierError ("verifier not found: ...") for a bad path."""
    VerifierSpec.from_path(path)
    return VerifierIdentity(path=str(Path(path).resolve()), fingerprint=verifier_fingerprint(path))


def weight_map(path: str | Path) -> dict[str, str]:
    """tensor name -> safetensors file name, from the index when sharded."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise VerifierError(f"verifier weight index {index} is unreadable ({type(e).__name__}: {e})") from None
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(list(f.keys()), single.name)
    raise VerifierError(f"no safetensors weights in {path} (expected model.safetensors or model.safetensors.index.json)")


def _match(names: list[str], tail: tuple[str, ...], what: str, path: Path) -> str | None:
    hits = [n for n in names if tuple(n.split(".")[-len(tail):]) == tail and ".layers." not in f".{n}"]
    if len(hits) > 1:  # prefer the language model's own (parent component "model"), e.g. language_model.model.norm
        preferred = [n for n in hits if n.split(".")[-len(tail) - 1 : -len(tail)] in (["model"], [])]
        hits = preferred or hits
    if len(hits) > 1:
        raise VerifierError(f"ambiguous {what} in {path}: {sorted(hits)}")
    return hits[0] if hits else None


def find_tensor_names(path: str | Path, wmap: dict[str, str] | None = None) -> dict[str, str | None]:
    """Names of the embedding, the final norm and lm_head in a (sharded, possibly prefixed) checkpoint."""
    path = Path(path)
    names = sorted(wmap if wmap is not None else weight_map(path))
    return {
        "embed_tokens": _match(names, ("embed_tokens", "weight"), "embedding", path),
        "norm": _match(names, ("norm", "weight"), "final norm", path),
        "lm_head": _match(names, ("lm_head", "weight"), "lm_head", path),
    }


def _shard(path: Path, name: str, wmap: dict[str, str]) -> Path:
    """The shard file of ``path`` that holds tensor ``name``; VerifierError naming it where there is none."""
    if name not in wmap:
        raise VerifierError(f"tensor {name} is not in the weights of {path}")
    shard = path / wmap[name]
    if not shard.is_file():
        raise VerifierError(f"shard {shard} (holding {name}) is missing: an incomplete download?")
    return shard


def tensor_shapes(path: str | Path, names: list[str], wmap: dict[str, str] | None = None) -> dict[str, tuple[int, ...]]:
    """name -> shape of the tensors ``names``, from their shards' safetensors headers (no tensor data is read)."""
    path = Path(path)
    wmap = wmap if wmap is not None else weight_map(path)
    by_shard: dict[Path, list[str]] = {}
    for name in names:
        by_shard.setdefault(_shard(path, name, wmap), []).append(name)
    shapes = {}
    for shard, group in by_shard.items():
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in group})
    return shapes


def read_tensor(path: str | Path, name: str, rows: torch.Tensor | None = None,
                wmap: dict[str, str] | None = None) -> torch.Tensor:
    """Read one tensor (or only the given strictly increasing ``rows`` of it) from the shard that holds it.
    ``wmap`` (from ``weight_map``) saves re-reading the index when several tensors are read."""
    shard = _shard(Path(path), name, wmap if wmap is not None else weight_map(path))
    if rows is not None:
        rows = rows.to(torch.long)
        if len(rows) == 0 or bool((rows[1:] <= rows[:-1]).any()) or int(rows[0]) < 0:
            raise VerifierError(f"rows of {name} must be non-empty, non-negative and strictly increasing")
    with safe_open(str(shard), framework="pt") as f:
        if rows is None:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        # read contiguous runs of ids: the draft vocab is sorted, so runs are long and memory stays at draft size
        breaks = torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1
        starts = torch.cat([torch.tensor([0]), breaks]).tolist()
        ends = torch.cat([breaks, torch.tensor([len(rows)])]).tolist()
        parts = [sl[int(rows[s]) : int(rows[e - 1]) + 1] for s, e in zip(starts, ends)]
        return torch.cat(parts, dim=0)


def layer_tensor_names(path: str | Path, layer: int, wmap: dict[str, str] | None = None) -> dict[str, str]:
    """Every tensor of decoder layer ``layer`` (vLLM's id k = the residual stream entering layer k, so layer k's own
    weights): tail after ``layers.<k>.`` (e.g. "mlp.up_proj.weight") -> full name. Where a checkpoint holds several
    ``layers`` stacks (a vision tower's, an MTP module's) the language model's is taken: the stack whose parent
    component is ``model`` or ``language_model`` (the rule ``find_tensor_names`` applies to the head). A name's
    first ``layers.<int>`` is its stack (experts' own ``layers`` below it are part of the tail)."""
    path = Path(path)
    names = wmap if wmap is not None else weight_map(path)
    stacks: dict[str, dict[str, str]] = {}
    for name in names:
        parts = name.split(".")
        for i in range(len(parts) - 2):
            if parts[i] == "layers" and parts[i + 1].isdigit():
                if parts[i + 1] == str(layer):
                    stacks.setdefault(".".join(parts[:i]), {})[".".join(parts[i + 2:])] = name
                break
    if len(stacks) > 1:
        preferred = {p: t for p, t in stacks.items() if p.split(".")[-1] in ("model", "language_model", "")}
        stacks = preferred or stacks
    if len(stacks) != 1:
        found = "no such layer" if not stacks else f"several layer stacks: {sorted(stacks)}"
        raise VerifierError(f"decoder layer {layer} in the weights of {path}: {found}")
    return next(iter(stacks.values()))


def read_layer(path: str | Path, layer: int, tails: tuple[str, ...],
               wmap: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``tails`` of decoder layer ``layer`` (``layer_tensor_names``) in float32."""
    wmap = wmap if wmap is not None else weight_map(path)
    found = layer_tensor_names(path, layer, wmap)
    missing = [t for t in tails if t not in found]
    if missing:
        raise VerifierError(f"decoder layer {layer} of {path} has no {', '.join(missing)}")
    return {t: read_tensor(path, found[t], wmap=wmap).float() for t in tails}


@dataclass
class VerifierHead:
    """The frozen verifier pieces the draft trains against; tensors in float32 on CPU."""

    norm_weight: torch.Tensor  # [hidden]
    rms_norm_eps: float
    lm_head: torch.Tensor  # [vocab or draft_vocab, hidden]
    embed_tokens: torch.Tensor | None  # [vocab, hidden]

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [..., hidden] -> [..., rows of lm_head]; see ``teacher_logits``."""
        return teacher_logits(final_hidden, self.norm_weight, self.rms_norm_eps, self.lm_head)


def teacher_logits(final_hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   lm_head: torch.Tensor) -> torch.Tensor:
    """The verifier's logits from its stored final state (output of the last layer, BEFORE the final norm):
    final RMSNorm, then lm_head (all rows, or the draft vocabulary's rows), in float32.

    final_hidden: [..., H]; norm_weight: [H]; lm_head: [rows, H] -> [..., rows]
    """
    h = final_hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return h @ lm_head.float().T


def load_verifier_head(
    path: str | Path, draft_token_ids: torch.Tensor | None = None, with_embedding: bool = True
) -> VerifierHead:
    """Final norm + lm_head (rows = sorted draft-vocab target ids when given) + optionally the embedding."""
    spec = VerifierSpec.from_path(path)
    wmap = weight_map(path)  # parsed once: Kimi-K2.5's index lists ~100k tensors
    names = find_tensor_names(path, wmap)
    if names["norm"] is None:
        raise VerifierError(f"final norm weight (…model.norm.weight) not found in {path}")
    lm_name = names["lm_head"] or (names["embed_tokens"] if spec.tie_word_embeddings else None)
    if lm_name is None:
        raise VerifierError(f"lm_head.weight not found in {path} and tie_word_embeddings is false")
    if with_embedding and names["embed_tokens"] is None:
        raise VerifierError(f"embed_tokens.weight not found in {path}")
    if draft_token_ids is not None and int(draft_token_ids.max()) >= spec.vocab_size:
        raise VerifierError(f"draft token id {int(draft_token_ids.max())} >= verifier vocab_size {spec.vocab_size}")
    return VerifierHead(
        norm_weight=read_tensor(path, names["norm"], wmap=wmap).float(),
        rms_norm_eps=spec.rms_norm_eps,
        lm_head=read_tensor(path, lm_name, rows=draft_token_ids, wmap=wmap).float(),
        embed_tokens=read_tensor(path, names["embed_tokens"], wmap=wmap).float() if with_embedding else None,
    )

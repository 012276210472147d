"""Draft checkpoints vLLM loads unchanged, and the trainer state that resumes a run (never pickled).

Pipeline position: train -> **checkpoint** -> validate / vLLM.

```
<train>/checkpoints/epoch-XXX/   config.json           flat vLLM config (DraftConfig.to_vllm_config)
                                 model.safetensors     fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
                                                       (+ embed_tokens.weight only when asked: vLLM shares the
                                                       verifier's embedding when it is absent)
                                 eagle3_run.json       run config, metrics, versions, git revision, verifier path
<train>/checkpoints/best         symlink -> epoch-XXX with the best validation simulated acceptance length
<train>/latest/                  trainer_state.safetensors (fp32 weights, optimizer moments, RNG states) +
                                 trainer_state.json (everything else: scheduler, counters, structure of the state)
```
Only ``latest/`` holds optimizer state (a Kimi-size draft's Adam moments are ~8 GB per copy). Every folder is written
under a temp name and renamed into place (eagle3.support.io.atomic_path).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle3.draft.config import DraftConfig
from eagle3.draft.model import Eagle3Draft
from eagle3.support.dtypes import torch_dtype
from eagle3.support.io import atomic_path, atomic_write_json, save_safetensors, sha256_file
from eagle3.support.provenance import git_revision, versions
from eagle3.support.verifier import find_tensor_names, read_tensor

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
RUN_INFO = "eagle3_run.json"
STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
EPOCH_RE = re.compile(r"^epoch-(\d{3,})$")
FROZEN = ("embed_tokens.weight",)
BUFFERS = ("d2t", "t2d")


class CheckpointError(ValueError):
    """A checkpoint or trainer-state folder is missing files or holds the wrong tensors; the message names it."""


# ----------------------------------------------------------------------------- vLLM-ready draft folder


def draft_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype,
                  include_embedding: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors from a draft state dict, named as vLLM loads them (no ``model.`` prefix); float
    weights cast to ``dtype``, the d2t / t2d tables kept as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in FROZEN and not include_embedding:
            continue
        t = t.detach().to("cpu")
        out[name] = (t if name in BUFFERS else t.to(dtype)).contiguous()
    return out


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a checkpoint of ``cfg``, read off the model itself (built on the meta device: no
    memory even at Kimi size). ``embed_tokens.weight`` is included; a checkpoint may omit it (FROZEN)."""
    with torch.device("meta"):
        model = Eagle3Draft(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def save_draft(folder: str | os.PathLike, cfg: DraftConfig, state: dict[str, torch.Tensor], run_info: dict[str, Any],
               include_embedding: bool = False) -> Path:
    """Write a vLLM-ready folder atomically from ``cfg`` and a draft state dict (``Eagle3Draft.state_dict()``);
    weights in ``cfg.torch_dtype``. ``run_info`` goes to eagle3_run.json with versions and the git revision."""
    folder = Path(folder)
    tensors = draft_tensors(state, torch_dtype(cfg.torch_dtype), include_embedding)
    info = {**run_info, "versions": versions(), "git_revision": git_revision(),
            "embedding_in_checkpoint": include_embedding}
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        (tmp / CONFIG).write_text(json.dumps(cfg.to_vllm_config(), indent=2) + "\n")
        save_safetensors(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / RUN_INFO).write_text(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")
    return folder


class WeightsCheck(NamedTuple):
    sha256: str | None  # of the folder's model.safetensors; None when the file is missing
    problem: str | None  # the sentence to show when it is not the file training recorded; None when it is


def check_weights(folder: str | os.PathLike, recorded_sha256: str | None) -> WeightsCheck:
    """Is ``folder``'s model.safetensors the one training recorded (``recorded_sha256``; None: nothing recorded,
    nothing to compare)? The one check of training's result, validation and the flow's final summary."""
    weights = Path(folder) / WEIGHTS
    sha = sha256_file(weights) if weights.is_file() else None
    if recorded_sha256 is None or sha == recorded_sha256:
        return WeightsCheck(sha, None)
    what = "is missing" if sha is None else "was changed or damaged since"
    return WeightsCheck(sha, f"the draft checkpoint {weights} does not match the sha256 recorded when training wrote "
                        f"it ({recorded_sha256[:12]}...): it {what}; do not serve it (restore the file, or delete "
                        f"the train-draft stage folder and rerun to train it again)")


def read_config(folder: str | os.PathLike) -> DraftConfig:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"draft config not found: {path}")
    try:
        return DraftConfig.from_vllm_config(json.loads(path.read_text()), where=str(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def read_run_info(folder: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's eagle3_run.json as a mapping ({} when the folder has none); an unreadable file is one
    CheckpointError naming it."""
    path = Path(folder) / RUN_INFO
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(info, dict) or not isinstance(info.get("run_config", {}), dict):
        raise CheckpointError(f"{path}: unreadable (not a mapping with a run_config mapping)")
    return info


def load_draft(folder: str | os.PathLike, verifier_path: str | os.PathLike | None = None,
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    """Rebuild an ``Eagle3Draft`` from a checkpoint folder; the embedding comes from the verifier when absent."""
    folder = Path(folder)
    cfg = read_config(folder)
    weights = folder / WEIGHTS
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read draft weights {weights}: {e}") from None
    # vLLM accepts `layers.0.` for `midlayer.`; so do we
    tensors = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in tensors.items()}
    draft = Eagle3Draft(cfg)
    want = dict(draft.state_dict())
    if "embed_tokens.weight" not in tensors:
        if verifier_path is None:
            verifier_path = read_run_info(folder).get("verifier")
        if not verifier_path:
            raise CheckpointError(f"{weights} has no embed_tokens.weight and no verifier path was given "
                                  f"(nor found in {folder / RUN_INFO})")
        embed = find_tensor_names(verifier_path)["embed_tokens"]
        if embed is None:
            raise CheckpointError(f"{weights} has no embed_tokens.weight and the verifier {verifier_path} has none")
        tensors["embed_tokens.weight"] = read_tensor(verifier_path, embed).float()
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{weights}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise CheckpointError(f"{weights}: {name} has shape {tuple(t.shape)}, config implies "
                                  f"{tuple(want[name].shape)}")
    draft.load_state_dict({k: (v if k in BUFFERS else v.float()) for k, v in tensors.items()})
    draft.embed_tokens.weight.requires_grad_(False)
    return draft.to(device=device, dtype=dtype) if dtype != torch.float32 else draft.to(device)


# ----------------------------------------------------------------------------- epochs, best, keep_last_n


def epoch_dir_name(epoch: int) -> str:
    """Epochs count from 1 in folder names: epoch-001 is the state after the first epoch."""
    return f"epoch-{epoch:03d}"


def list_epoch_dirs(ckpt_dir: str | os.PathLike) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.is_symlink() and EPOCH_RE.match(p.name)]
    return sorted(dirs, key=lambda p: int(EPOCH_RE.match(p.name).group(1)))


def set_best(ckpt_dir: str | os.PathLike, epoch_dir: str | os.PathLike) -> Path:
    """Point ``<ckpt_dir>/best`` at ``epoch_dir`` (relative symlink, swapped atomically)."""
    ckpt_dir = Path(ckpt_dir)
    link = ckpt_dir / "best"
    tmp = ckpt_dir / f".best.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(Path(epoch_dir).name, tmp)
    os.replace(tmp, link)
    return link


def best_dir(ckpt_dir: str | os.PathLike) -> Path | None:
    link = Path(ckpt_dir) / "best"
    return link.resolve() if link.is_symlink() and link.resolve().is_dir() else None


def prune_epochs(ckpt_dir: str | os.PathLike, keep_last_n: int) -> list[Path]:
    """Delete epoch folders beyond the newest ``keep_last_n`` (0 = keep all), never the ``best`` one.

    Returns the deleted folders.
    """
    if keep_last_n <= 0:
        return []
    dirs = list_epoch_dirs(ckpt_dir)
    best = best_dir(ckpt_dir)
    doomed = [d for d in dirs[:-keep_last_n] if best is None or d.resolve() != best]
    for d in doomed:
        shutil.rmtree(d)
    return doomed


# ----------------------------------------------------------------------------- trainer state without pickle


def _encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """JSON skeleton of nested dict/list/tuple/scalars; tensors go to ``tensors`` and leave a reference."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        items = [[_key(k), _encode(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]
        return {"__dict__": items}
    if isinstance(obj, (list, tuple)):
        enc = [_encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": enc} if isinstance(obj, tuple) else enc
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"trainer state {prefix}: cannot store a {type(obj).__name__} without pickle")


def _key(k: Any) -> Any:
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    raise CheckpointError(f"trainer state: dict key {k!r} is neither str nor int")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {k: _decode(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def save_trainer_state(folder: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` (nested dicts/lists/tuples of tensors and JSON scalars) as safetensors + JSON, atomically."""
    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, "s")
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        save_safetensors(tensors, tmp / STATE_TENSORS, metadata={"format": "pt"})
        atomic_write_json(tmp / STATE_JSON, {"format": "eagle3-trainer-state/1", "state": skeleton})
    return folder


def load_trainer_state(folder: str | os.PathLike) -> dict[str, Any]:
    folder = Path(folder)
    meta, weights = folder / STATE_JSON, folder / STATE_TENSORS
    if not meta.is_file() or not weights.is_file():
        raise CheckpointError(f"trainer state in {folder} is incomplete: need {STATE_JSON} and {STATE_TENSORS}")
    try:
        skeleton = json.loads(meta.read_text())
        tensors = load_file(str(weights))
    except (json.JSONDecodeError, SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read trainer state in {folder}: {e}") from None
    if skeleton.get("format") != "eagle3-trainer-state/1":
        raise CheckpointError(f"{meta}: unknown format {skeleton.get('format')!r}")
    try:
        return _decode(skeleton["state"], tensors)
    except KeyError as e:
        raise CheckpointError(f"{meta} refers to tensor {e.args[0]} missing from {weights}") from None

"""The hidden-state store's format: file layout, metadata, sample bytes (docs/DESIGN.md, "Hidden-state store").

Pipeline position: owned by nobody's stage: extraction writes it (eagle3.extract), the capacity plan sizes it, the
trainer reads it (``eagle3.store.reader``). This module is the layout alone (no I/O but the bytes of one sample).

```
store/store.json      format, verifier + fingerprint, aux_layer_ids (vLLM convention), hidden_size, n_aux, dtype,
                      compute_dtype, num_samples (dataset size), backend, group_size
store/manifest.jsonl  one line per FINISHED sample (eagle3.store.manifest):
                      {"index": i, "file": "rows_0-1999/sample_000000012.safetensors", "tokens": T,
                       "tokens_sha256": ..., "sha256": ..., "bytes": ...}
store/rows_<a>-<b>/sample_<index:09d>.safetensors
   aux_hidden_states   [T, n_aux * H]  store dtype, aux states concatenated in aux_layer_ids order (fc's input)
   final_hidden_state  [T, H]          store dtype, output of the LAST decoder layer BEFORE the final norm
   input_ids           [T] int64
   loss_mask           [T] uint8 (1 = assistant token)
 and, only in a store of a scaled dtype (float8_e4m3fn, ``eagle3.support.dtypes.SCALED_DTYPES``):
   aux_hidden_states_scale   [T, n_aux] float32   one scale per token and per aux state
   final_hidden_state_scale  [T, 1] float32
   state = stored value * scale; scale = the state's absmax / the dtype's max (448), so every token's states keep
   their own range (``quantize_states`` / ``dequantize_states``)
```
Identity (``store_identity``): what was extracted, not the bytes: the metadata (without the verifier's path) and each
sample's index, token count and ``tokens_sha256`` (its input_ids and loss mask). Each file's bytes are checked against
its own ``sha256`` where it is read. So a damaged sample extracted again (its states equal to float rounding, not
byte for byte: another batch composition) keeps the store's identity, and with it training's cache key and resume
state.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from eagle3.support.dtypes import DTYPES, SCALED_DTYPES
from eagle3.support.dtypes import STORE_DTYPES as _STORE_DTYPE_NAMES
from eagle3.support.io import sha256_json

FORMAT = "eagle3-hidden-states/1"
STORE_JSON = "store.json"
MANIFEST = "manifest.jsonl"
QUARANTINE = "quarantine"  # samples that failed their hash check, moved aside for inspection (never read again)
DEFAULT_GROUP_SIZE = 2000
TMP_SUFFIX = ".tmp"
KEYS = ("aux_hidden_states", "final_hidden_state", "input_ids", "loss_mask")
TOKEN_TENSORS = (("input_ids", "int64"), ("loss_mask", "uint8"))  # per-token bookkeeping stored beside the states
# one key only: safetensors writes a multi-key metadata map in a per-process order, so the same tensors would give
# different bytes (and sha256) in different processes; the sample's index lives in its file name and manifest line
SAMPLE_METADATA = {"format": "pt"}

STORE_DTYPES = {name: DTYPES[name].torch for name in _STORE_DTYPE_NAMES}  # store.json "dtype" -> torch dtype
STATE_KEYS = ("aux_hidden_states", "final_hidden_state")
SCALE_SUFFIX = "_scale"  # "<state key>_scale": the float32 scales of a scaled store's states
SCALE_DTYPE = "float32"
# keys of store.json that must match for a rerun to resume into an existing store
_RESUME_KEYS = ("format", "verifier_fingerprint", "aux_layer_ids", "hidden_size", "n_aux", "dtype", "compute_dtype",
                "num_samples", "group_size")


class StoreError(ValueError):
    """A store folder, its metadata or one of its samples is not usable; the message names the path / sample."""


class CorruptSample(StoreError):
    """A sample's file does not match its manifest line (size, sha256, header); it was moved to quarantine/."""


def group_dir_name(index: int, group_size: int) -> str:
    """``rows_<a>-<b>``: the folder holding sample ``index`` (groups of ``group_size`` samples)."""
    a = index // group_size * group_size
    return f"rows_{a}-{a + group_size - 1}"


def sample_relpath(index: int, group_size: int) -> str:
    return f"{group_dir_name(index, group_size)}/sample_{index:09d}.safetensors"


def sample_files(store_dir: str | os.PathLike) -> list[Path]:
    """Every finished sample file of a store, in file order (``sample_relpath``'s layout; temp files start with a
    dot and end in ``TMP_SUFFIX``, quarantined ones lie in ``QUARANTINE``: neither is listed)."""
    return sorted(Path(store_dir).glob("rows_*/sample_*.safetensors"))


def inside_store(rel: object) -> bool:
    """True when a manifest ``file`` names a sample file inside the store: the relative path
    ``rows_<a>-<b>/sample_<index>.safetensors`` (never absolute, never ``..``; symlinks are refused when read)."""
    if not isinstance(rel, str) or "\\" in rel:
        return False
    p = PurePosixPath(rel)
    return (not p.is_absolute() and len(p.parts) == 2 and p.parts[0].startswith("rows_")
            and p.name.startswith("sample_") and p.suffix == ".safetensors" and ".." not in p.parts)


def _verifier_fingerprint(verifier: str | os.PathLike) -> str:
    from eagle3.support.verifier import verifier_fingerprint  # the one recipe (imported late: pydantic)

    return verifier_fingerprint(verifier)


def store_meta(
    *,
    verifier: str | os.PathLike,
    aux_layer_ids: list[int],
    hidden_size: int,
    dtype: str,
    num_samples: int,
    backend: str = "transformers",
    group_size: int = DEFAULT_GROUP_SIZE,
    fingerprint: str | None = None,
    compute_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``store.json`` dict. ``aux_layer_ids`` in vLLM's convention (id k = residual stream entering layer k);
    ``compute_dtype``: what the verifier computed in (a resume or a shard on a device that would compute in another
    dtype is refused: the store would mix states computed two ways)."""
    if dtype not in STORE_DTYPES:
        raise StoreError(f"store dtype {dtype!r} not supported; use one of {sorted(STORE_DTYPES)}")
    if group_size < 1:
        raise StoreError(f"group_size must be >= 1 sample, got {group_size}")
    return {
        "format": FORMAT,
        "verifier": str(verifier),
        "verifier_fingerprint": fingerprint if fingerprint is not None else _verifier_fingerprint(verifier),
        "aux_layer_ids": [int(k) for k in aux_layer_ids],
        "hidden_size": int(hidden_size),
        "n_aux": len(aux_layer_ids),
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "num_samples": int(num_samples),
        "backend": backend,
        "group_size": int(group_size),
    }


def is_scaled(dtype: str | torch.dtype) -> bool:
    """True for a store dtype whose states are stored with per-token, per-state scales (float8_e4m3fn)."""
    return any(dtype in (name, DTYPES[name].torch) for name in SCALED_DTYPES)


def sample_tensors(tokens: int, n_aux: int, hidden_size: int, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of every tensor in the file of a ``tokens``-token sample of a store of ``dtype``:
    the file layout, which ``serialize_sample`` writes and the capacity plan sizes."""
    out = [("aux_hidden_states", dtype, (tokens, n_aux * hidden_size)),
           ("final_hidden_state", dtype, (tokens, hidden_size))]
    if is_scaled(dtype):
        out += [("aux_hidden_states" + SCALE_SUFFIX, SCALE_DTYPE, (tokens, n_aux)),
                ("final_hidden_state" + SCALE_SUFFIX, SCALE_DTYPE, (tokens, 1))]
    return out + [(name, dt, (tokens,)) for name, dt in TOKEN_TENSORS]


def quantize_states(x: torch.Tensor, n_states: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, n_states * H] (any float dtype, any device) -> (q [T, n_states * H] ``dtype``, scale [T, n_states]
    float32) on CPU, with x ~= q * scale per state.

    One scale per token and per state (absmax / the dtype's max): a state's outlier channels (hundreds of times its
    typical magnitude in deep layers) set only that token's scale. An all-zero state gets scale 1 (stored exactly).
    Error of q * scale against x (computed in float32): at most 2**-4 |x| (3 mantissa bits, round to nearest), or
    2**-10 * scale for values in float8_e4m3fn's subnormal range (|x| < 2**-6 * scale).
    """
    t = int(x.shape[0])
    xf = x.detach().to("cpu", torch.float32).reshape(t, n_states, -1)  # [T, n, H]
    top = torch.finfo(dtype).max
    scale = xf.abs().amax(dim=-1) / top  # [T, n]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # NaN/Inf stay: verify(check_finite) sees them
    q = (xf / scale[..., None]).clamp_(-top, top).to(dtype)  # clamp: float32 rounding may land just above max
    return q.reshape(t, -1), scale


def dequantize_states(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [T, n * H] scaled store dtype, scale: [T, n] float32 -> states [T, n * H] in ``out`` (written in place,
    any float dtype; e.g. a slice of a padded batch) or a new ``dtype`` tensor.

    The scale is cast to the output dtype first: a bf16 x float32 in-place multiply takes a ~15x slower CPU path.
    In bf16 the result carries bf16 rounding on top of the quantization error (about 2**-8 relative).
    """
    t, width = q.shape
    n = int(scale.shape[1])
    if out is None:
        out = torch.empty(t, width, dtype=dtype, device=q.device)
    out.copy_(q)
    out.unflatten(1, (n, width // n)).mul_(scale.to(out.dtype)[:, :, None])
    return out


def serialize_sample(
    aux: torch.Tensor, final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, dtype: torch.dtype,
    index: int,
) -> bytes:
    """safetensors bytes of one sample (shapes checked; states cast to the store ``dtype``, or quantized with
    their scales for a scaled dtype: ``sample_tensors`` lists the file's tensors).

    aux: [T, n_aux * H], final: [T, H], input_ids: [T], loss_mask: [T]
    """
    t = int(input_ids.shape[0])
    scaled = is_scaled(dtype)
    if aux.dim() != 2 or final.dim() != 2 or aux.shape[0] != t or final.shape[0] != t or loss_mask.shape != (t,) \
            or (scaled and (final.shape[1] == 0 or aux.shape[1] % final.shape[1])):
        raise StoreError(
            f"sample {index}: inconsistent shapes aux {tuple(aux.shape)}, final {tuple(final.shape)}, "
            f"input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)} (want [T, n_aux*H], [T, H], [T], [T])"
        )
    tensors: dict[str, torch.Tensor] = {}
    for key, x in zip(STATE_KEYS, (aux, final)):
        if scaled:
            tensors[key], tensors[key + SCALE_SUFFIX] = quantize_states(x, int(x.shape[1]) // int(final.shape[1]),
                                                                       dtype)
        else:
            tensors[key] = x.detach().to("cpu", dtype).contiguous()
    tensors["input_ids"] = input_ids.detach().to("cpu", torch.int64).contiguous()
    tensors["loss_mask"] = loss_mask.detach().to("cpu", torch.uint8).contiguous()
    return safetensors_save(tensors, metadata=SAMPLE_METADATA)


def token_digest(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    """sha256 of a sample's tokens and loss mask (int64 and uint8 bytes): the part of its identity that extraction's
    numerics cannot change. input_ids, loss_mask: [T]."""
    h = hashlib.sha256(input_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    h.update(loss_mask.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes())
    return h.hexdigest()


def sample_entry(index: int, tokens: int, data: bytes, tokens_sha256: str, group_size: int) -> dict[str, Any]:
    """The manifest entry of one serialized sample."""
    return {"index": int(index), "file": sample_relpath(index, group_size), "tokens": int(tokens),
            "tokens_sha256": tokens_sha256, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def store_identity(meta: dict[str, Any], entries: dict[int, dict[str, Any]]) -> str:
    """The store's identity (its artifact's fingerprint, hence downstream cache keys): the metadata without the
    verifier's path, and per listed sample its index, tokens and token digest. A manifest written before token
    digests existed stands by its files' sha256 instead."""
    meta = {k: v for k, v in meta.items() if k != "verifier"}
    return sha256_json({"meta": meta, "samples": [[i, int(entries[i]["tokens"]),
                                                   entries[i].get("tokens_sha256") or entries[i]["sha256"]]
                                                  for i in sorted(entries)]})

"""The one dtype table of the project, and the rules that pick compute and store dtypes.

Every dtype name, torch dtype, safetensors code and byte size the pipeline uses comes from ``DTYPES``; configs
spell dtypes by their torch name without the ``torch.`` prefix ("bfloat16"). Imports torch only (the vLLM
environment imports this module too).

Compute dtype (``resolve_compute_dtype``): ``auto`` means the checkpoint's own dtype on a GPU, but on a CPU only
when the CPU multiplies that dtype natively; otherwise float32. Measured: a bf16 checkpoint computed in bf16 on a CPU
whose bf16 matmul does not go through native instructions was about 20x slower than float32 (SmolLM2 extraction:
over 6 minutes for one 8K-token batch, shared/ENV.md), while on this project's AMD EPYC with AVX512-BF16 (oneDNN)
bf16 ran 1.5-2.5x FASTER than float32 (bench/smollm2_cpu_forward.py). The same rule serves extraction,
regeneration, training and the offline reference.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("eagle3")


@dataclass(frozen=True)
class DType:
    name: str  # torch's name without the "torch." prefix
    torch: torch.dtype
    safetensors: str  # the dtype code in a safetensors header
    bytes: int  # per element
    floating: bool


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float64", torch.float64, "F64", 8, True),
    DType("float32", torch.float32, "F32", 4, True),
    DType("bfloat16", torch.bfloat16, "BF16", 2, True),
    DType("float16", torch.float16, "F16", 2, True),
    DType("float8_e4m3fn", torch.float8_e4m3fn, "F8_E4M3", 1, True),  # store only: needs a scale (SCALED_DTYPES)
    DType("int64", torch.int64, "I64", 8, False),
    DType("int32", torch.int32, "I32", 4, False),
    DType("int16", torch.int16, "I16", 2, False),
    DType("int8", torch.int8, "I8", 1, False),
    DType("uint8", torch.uint8, "U8", 1, False),
    DType("bool", torch.bool, "BOOL", 1, False),
)}
_BY_CODE = {d.safetensors: d for d in DTYPES.values()}
_BY_TORCH = {d.torch: d for d in DTYPES.values()}

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")  # what a verifier or draft may run in
STORE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")  # what the hidden-state store may hold
# store dtypes too narrow in range for raw states: each token's state is stored divided by a float32 scale
# (eagle3.store quantize_states / dequantize_states)
SCALED_DTYPES = ("float8_e4m3fn",)


class DTypeError(ValueError):
    """An unknown or unsupported dtype name; the message lists the accepted ones."""


def dtype(name: str | torch.dtype) -> DType:
    """The table entry of a dtype given by name ("bfloat16", "torch.bfloat16") or torch dtype."""
    if isinstance(name, torch.dtype):
        if name in _BY_TORCH:
            return _BY_TORCH[name]
        raise DTypeError(f"unsupported torch dtype {name}")
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise DTypeError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    return dtype(name).torch


def from_safetensors(code: str) -> DType:
    """The table entry of a safetensors header dtype code ("BF16")."""
    if code not in _BY_CODE:
        raise DTypeError(f"unsupported safetensors dtype {code!r}; known: {sorted(_BY_CODE)}")
    return _BY_CODE[code]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 matmul instructions (x86 AVX512-BF16 / AMX-BF16, arm64 BF16 / SVE-BF16) AND
    torch routes bf16 matmul to them (oneDNN enabled and bf16-capable). Both are needed: without the oneDNN route,
    bf16 matmul was 5x slower than float32 on a CPU that has the instructions (measured)."""
    try:
        caps = torch.cpu.get_capabilities()
        native = any(caps.get(k, False) for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
        routed = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return bool(native and routed)
    except Exception:  # noqa: BLE001 - an older torch or no oneDNN in this build: assume no native bf16
        return False


class DeviceError(ValueError):
    """A device that this host does not have (e.g. 'cuda' without CUDA)."""


def device_type(device: str | torch.device | None) -> str:
    """"cuda" or "cpu" for a device spec; "auto"/None mean cuda when available. THE device rule: every stage
    resolves its device setting through this (or ``resolve_device``)."""
    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def resolve_device(device: str | torch.device | None, local_rank: int = 0) -> torch.device:
    """The torch device of a device setting: "auto"/None = cuda:<local_rank> when CUDA is available, else cpu; a
    bare "cuda" = cuda:<local_rank> (one process per GPU); "cuda:1" as written. DeviceError when CUDA is asked for
    and this host has none."""
    kind = device_type(device)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(device)!r} requested but CUDA is not available on this host")
        d = torch.device(device) if device is not None and str(device) != "auto" else torch.device("cuda")
        return d if d.index is not None else torch.device("cuda", local_rank)
    return torch.device(kind)


def resolve_compute_dtype(requested: str, checkpoint_dtype: str, device: str | torch.device | None) -> str:
    """The dtype a model is computed in. ``requested`` "auto" = the checkpoint's dtype where it is fast: always
    on CUDA; on a CPU only float32, or bfloat16 when the CPU has native bf16 matmul; anything else -> float32."""
    if requested != "auto":
        return dtype(requested).name
    ckpt = dtype(checkpoint_dtype).name
    if device_type(device) != "cpu" or ckpt == "float32":
        return ckpt
    if ckpt == "bfloat16" and cpu_has_native_bf16():
        return ckpt
    return "float32"


def describe_compute_dtype(requested: str, checkpoint_dtype: str, device: str | torch.device | None) -> str:
    """``resolve_compute_dtype`` plus one log line saying why, for the stages to print."""
    chosen = resolve_compute_dtype(requested, checkpoint_dtype, device)
    if requested == "auto" and chosen != dtype(checkpoint_dtype).name:
        log.info("dtype auto: computing in %s, not the checkpoint's %s: this CPU has no native %s matmul (it would "
                 "run ~20x slower)", chosen, dtype(checkpoint_dtype).name, dtype(checkpoint_dtype).name)
    return chosen


def resolve_store_dtype(store_dtype: str, compute_dtype: str) -> str:
    """The dtype of stored hidden states: ``model`` = the compute dtype (resolved), else the named one."""
    name = compute_dtype if store_dtype == "model" else store_dtype
    if dtype(name).name not in STORE_DTYPES:
        raise DTypeError(f"store dtype {name!r} not supported; use one of {list(STORE_DTYPES)} or 'model'")
    return dtype(name).name

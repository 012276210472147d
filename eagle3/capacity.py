"""Capacity planning before extraction: how many bytes the hidden-state store needs, whether the destination holds
them with a margin, and roughly how long extraction and training take.

Pipeline position: data -> **capacity** -> extract. Reads the verifier's ``config.json`` only (no weights; the
weight byte count comes from the safetensors index or file sizes) and the per-sample token lengths of the prepared
dataset (the ``input_ids`` list lengths, read from Arrow without touching the token values).

Store bytes per sample of T tokens (docs/DESIGN.md, one safetensors file per sample):

    hidden states  T * (n_aux + 1) * hidden * dtype_bytes      aux_hidden_states [T, n_aux*H] + final [T, H]
                   + T * (n_aux + 1) * 4 for a scaled dtype     float32 scales per token and state (float8_e4m3fn)
    overhead       T * (8 + 1) + header(T)                      input_ids int64 + loss_mask uint8 + safetensors header

(manifest.jsonl lines, ~150 bytes per sample, and filesystem block rounding are left to the margin.)

Kimi-K2.5 (hidden 7168, aux [2, 30, 58] + final, bf16): 57,344 B/token of hidden states, 29,360,128 B for 512 tokens;
float8_e4m3fn: 28,688 B/token (28,672 + 16 of scales), 0.5003 of bf16.
Aux layer ids are in vLLM's convention (id k = residual stream ENTERING decoder layer k).

Training time (``plan_training_time``), for E epochs over the training split S = N (1 - val_ratio) samples on
W = nodes x nproc GPUs:

    compute        E * S * training_gpu_seconds_per_sample / W
    network        nodes > 1: every optimizer step all-reduces the float32 gradients across the hosts (inside a host
                   NCCL runs over NVLink, counted in the compute figure): 2 (nodes - 1) / nodes * 4 * P bytes through
                   each host's links (P trainable parameters), at internode_bytes_per_second, for
                   E * ceil(S / batch_size) steps (at least: one sample per packed row; packing shares rows)
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from eagle3.chat.dataset import PreparedDataset
from eagle3.draft.config import DraftConfigError, serving_pair_problem
from eagle3.extract.config import ExtractConfig
from eagle3.prepare import PreparedData
from eagle3.regenerate.config import RegenerateConfig
from eagle3.store import SAMPLE_METADATA, TOKEN_TENSORS, is_scaled, sample_tensors
from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.display import sig, size
from eagle3.support.dtypes import describe_compute_dtype, device_type, dtype, from_safetensors
from eagle3.support.io import atomic_write_json, sha256_file, sha256_json
from eagle3.support.progress import fmt_duration
from eagle3.support.settings import SETTINGS_MODEL
from eagle3.support.verifier import VerifierIdentity, VerifierSpec
from eagle3.train.estimate import TrainingShape, plan_training_time
from eagle3.validate.baseline import reuse_problem
from eagle3.validate.config import ValidateConfig

log = logging.getLogger("eagle3")

PLAN_FILE = "plan.json"


class CapacityError(ValueError):
    """The store would not fit at the destination (or the plan's input is unusable); the message gives the numbers."""


class CapacityConfig(BaseModel):
    """Disk and time planning knobs for the hidden-state store."""

    model_config = SETTINGS_MODEL

    disk_margin_fraction: float = Field(
        0.10,
        ge=0.0,
        description="Extra free space required on top of the store's exact size, as a fraction of that size "
        "(0.10 = the destination must have 110% of the store's bytes free).",
    )
    model_load_seconds: float | None = Field(
        None,
        ge=0.0,
        description="Seconds to load the verifier before extraction starts. None = derive it as weight bytes "
        "(safetensors index total_size, else the *.safetensors file sizes) / model_load_bytes_per_second.",
    )
    model_load_bytes_per_second: float = Field(
        450e6,
        gt=0.0,
        description="Bytes per second the verifier loads at, used when model_load_seconds is None. 450 MB/s "
        "reproduces the original Kimi-K2.5 run: roughly 595 GB of weights in about 22 minutes (1,320 s).",
    )
    extraction_tokens_per_second: float = Field(
        2500.0,
        gt=0.0,
        description="Tokens per second of hidden-state extraction (prefill + store writes); the original Kimi-K2.5 "
        "run measured 2,300-2,900 tokens/s on its GPU node.",
    )
    generation_tokens_per_second: float = Field(
        300.0,
        gt=0.0,
        description="Tokens per second the verifier generates in vLLM over a whole batch (the regenerate stage's "
        "time estimate); measured on this project's 2 CPU cores for SmolLM2-135M: see the README.",
    )
    training_gpu_seconds_per_sample: float = Field(
        1.41,
        gt=0.0,
        description="GPU-seconds to train the draft on one sample for one epoch (every TTT step, forward + "
        "backward, on one GPU; validation and saves included, the network between hosts aside). The original "
        "Kimi-K2.5 run: 950 training samples (1,000, 5% held out) x 10 epochs in 28 minutes on 8 GPUs = 1.41 GPU-s. "
        "Longer samples or another draft width scale it.",
    )
    internode_bytes_per_second: float = Field(
        50e9,
        gt=0.0,
        description="Bytes per second between two training hosts, per host (all its network links together; one "
        "400 Gb/s InfiniBand NDR link = 50e9): with train.nodes > 1 each optimizer step all-reduces the float32 "
        "gradients across the hosts (the training time estimate's network part).",
    )
    on_insufficient: Literal["fail", "warn"] = Field(
        "fail",
        description="What to do when the store (plus margin) exceeds the destination's free bytes: 'fail' raises "
        "CapacityError before extraction, 'warn' records a warning in the plan and goes on.",
    )


class StorePlan(BaseModel):
    """Bytes (exact for this dataset) and seconds (estimates) of one extraction. All sizes in bytes."""

    model_config = ConfigDict(extra="forbid")

    verifier: str
    aux_layer_ids: list[int] = Field(description="vLLM convention: id k = residual stream entering decoder layer k")
    hidden_size: int
    num_hidden_layers: int
    store_dtype: str
    dtype_bytes: int
    bytes_per_token: int = Field(description="hidden-state bytes per token: (n_aux + 1) * hidden * dtype_bytes, "
                                 "plus (n_aux + 1) float32 scales for a scaled dtype (float8_e4m3fn)")
    overhead_bytes_per_token: int = Field(description="input_ids int64 + loss_mask uint8 per token")
    num_samples: int
    total_tokens: int
    longest_sample_tokens: int
    max_seq_len: int = Field(description="tokens; the data stage's cap on sample length")
    hidden_state_bytes: int
    overhead_bytes: int = Field(description="per-token bookkeeping + safetensors headers of every sample file")
    header_bytes: int = Field(description="safetensors headers alone (part of overhead_bytes)")
    total_bytes: int = Field(description="exact store size for this dataset: hidden_state_bytes + overhead_bytes")
    worst_case_tokens: int = Field(description="num_samples * max_seq_len")
    worst_case_bytes: int = Field(description="store size if every sample had max_seq_len tokens")
    destination: str
    free_bytes: int | None = Field(description="free bytes at the destination; None = the filesystem cannot tell")
    free_space_checked_at: str | None = Field(description="existing folder whose filesystem was measured")
    disk_margin_fraction: float
    required_free_bytes: int = Field(description="ceil(total_bytes * (1 + disk_margin_fraction))")
    fits: bool | None = Field(description="required_free_bytes <= free_bytes; None when free space is unknown")
    weight_bytes: int | None = Field(description="verifier weight bytes (index total_size or file sizes)")
    model_load_seconds: float
    model_load_source: str
    extraction_tokens_per_second: float
    extraction_seconds: float
    estimated_seconds: float = Field(description="model_load_seconds + extraction_seconds")
    warnings: list[str]

    def summary(self) -> str:
        free = "unknown" if self.free_bytes is None else _bytes(self.free_bytes)
        verdict = {True: "fits", False: "DOES NOT FIT", None: "free space unknown"}[self.fits]
        lines = [
            (f"Hidden-state store for {self.num_samples:,} samples, {self.total_tokens:,} tokens "
             f"(longest {self.longest_sample_tokens:,}, max_seq_len {self.max_seq_len:,} tokens)"),
            (f"  {self.bytes_per_token:,} bytes per token = ({len(self.aux_layer_ids)} aux layers "
             f"{self.aux_layer_ids} (vLLM ids) + final) x hidden {self.hidden_size:,} x {self.dtype_bytes} bytes "
             f"({self.store_dtype})" + (f" + {len(self.aux_layer_ids) + 1} float32 scales"
                                        if is_scaled(self.store_dtype) else "")),
            (f"  exact size: {_bytes(self.total_bytes)} = hidden states {_bytes(self.hidden_state_bytes)} "
             f"+ overhead {_bytes(self.overhead_bytes)} (token ids, loss masks, file headers)"),
            f"  worst case at max_seq_len: {_bytes(self.worst_case_bytes)}",
            (f"  destination {self.destination}: free {free}, needed with {self.disk_margin_fraction:.0%} margin "
             f"{_bytes(self.required_free_bytes)}: {verdict}"),
            (f"  time estimate: {fmt_duration(self.estimated_seconds)} (h:mm:ss) = model load "
             f"{fmt_duration(self.model_load_seconds)} ({self.model_load_source}) + extraction "
             f"{fmt_duration(self.extraction_seconds)} at {self.extraction_tokens_per_second:,.0f} tokens/s"),
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _bytes(n: int) -> str:
    """Exact bytes, then for people (eagle3.support.display): 29,071,893 bytes (29.1 MB); GiB too from 1 GiB up."""
    gib = f", {sig(n / 2**30)} GiB" if n >= 2**30 else ""
    return f"{n:,} bytes ({size(n)}{gib})"


def safetensors_header_bytes(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str] | None = None
) -> int:
    """Bytes before the tensor data in a safetensors file: 8-byte length + JSON header padded to a multiple of 8.

    ``tensors``: (name, safetensors dtype such as "BF16", shape). Mirrors the safetensors writer: ``__metadata__``
    first, tensors laid out by dtype size (largest first) then name, compact JSON, padding with spaces.
    """
    def size(code: str) -> int:
        return from_safetensors(code).bytes

    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, code, shape in sorted(tensors, key=lambda t: (-size(t[1]), t[0])):
        nbytes = size(code) * math.prod(shape)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    n = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + n + (-n) % 8


def store_file_bytes(tokens: int, n_aux: int, hidden_size: int, store_dtype: str) -> tuple[int, int, int]:
    """(hidden-state bytes (scales included), per-token bookkeeping bytes, header bytes) of the store file of a
    ``tokens``-token sample.

    Sizes the layout ``eagle3.store.sample_tensors`` gives (what ``serialize_sample`` writes, with
    ``SAMPLE_METADATA``); the header depends on the token count only.
    """
    layout = sample_tensors(tokens, n_aux, hidden_size, dtype(store_dtype).name)
    header = safetensors_header_bytes([(name, dtype(dt).safetensors, shape) for name, dt, shape in layout],
                                      SAMPLE_METADATA)
    sizes = {name: dtype(dt).bytes * math.prod(shape) for name, dt, shape in layout}
    bookkeeping = sum(sizes[name] for name, _ in TOKEN_TENSORS)
    return sum(sizes.values()) - bookkeeping, bookkeeping, header


def _total_header_bytes(lengths: np.ndarray, n_aux: int, hidden_size: int, store_dtype: str) -> int:
    """Sum of the store's file headers for samples 0..N-1 of the given token lengths [N].

    Headers differ only through the token count: one computation per distinct length.
    """
    if not len(lengths):
        return 0
    values, reps = np.unique(lengths, return_counts=True)
    return sum(int(r) * store_file_bytes(int(t), n_aux, hidden_size, store_dtype)[2] for t, r in zip(values, reps))


def assistant_layout(dataset_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(non-assistant tokens [N], assistant turns [N]) of every sample of a prepared dataset (eagle3.chat.dataset)."""
    return PreparedDataset(dataset_dir, CapacityError).assistant_layout()


def sample_lengths(dataset_dir: str | Path) -> np.ndarray:
    """Token count of every sample of a prepared dataset -> [num_samples] int64, from the Arrow list offsets only."""
    return PreparedDataset(dataset_dir, CapacityError).lengths


def free_space(dest: str | os.PathLike) -> tuple[int | None, str | None, str | None]:
    """(free bytes, folder measured, warning). Local paths (also file://) are measured with psutil at the nearest
    existing folder; other fsspec filesystems expose no free-space call, so they come back unknown with a warning."""
    import fsspec
    import psutil
    from fsspec.implementations.local import LocalFileSystem

    dest = os.fspath(dest)
    try:
        fs, path = fsspec.core.url_to_fs(dest)
    except (ImportError, ValueError) as e:
        return None, None, f"cannot open destination {dest} with fsspec ({e}); free space unknown, not checked"
    if not isinstance(fs, LocalFileSystem):
        return None, None, (
            f"destination {dest} is on a {type(fs).__name__} filesystem, which cannot report free space; "
            "free space unknown, not checked"
        )
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(psutil.disk_usage(str(p)).free), str(p), None


def _weight_bytes(spec: VerifierSpec) -> int | None:
    index = spec.path / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CapacityError(f"verifier weight index {index} is unreadable ({type(e).__name__}: {e})") from None
        if total:
            return int(total)
    files = list(spec.path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def plan_store(
    verifier_path: str | Path,
    aux_layer_ids: Sequence[int] | None,
    store_dtype: str,
    dataset: str | Path | Sequence[int],
    dest: str | os.PathLike,
    cfg: CapacityConfig,
    max_seq_len: int,
) -> StorePlan:
    """Plan the store of ``dataset`` (a prepared dataset folder, or its per-sample token lengths) at ``dest``.

    ``aux_layer_ids`` use vLLM's convention (None = the verifier's default, resolved by the one rule);
    ``store_dtype`` is the resolved store dtype (``ExtractConfig.resolved_dtypes``). Raises ``CapacityError`` when
    ``cfg.on_insufficient == "fail"`` and the store plus margin exceeds the destination's free space; a destination
    whose free space is unknown only warns.
    """
    spec = VerifierSpec.from_path(verifier_path)
    aux = spec.resolve_aux_layer_ids(None if aux_layer_ids is None else list(aux_layer_ids))
    if max_seq_len <= 0:
        raise CapacityError(f"max_seq_len must be a positive number of tokens, got {max_seq_len}")
    lengths = sample_lengths(dataset) if isinstance(dataset, (str, Path)) else np.asarray(dataset, dtype=np.int64)
    if lengths.ndim != 1 or (len(lengths) and int(lengths.min()) < 0):
        raise CapacityError("sample lengths must be a flat list of non-negative token counts")
    warnings: list[str] = []

    n_aux, hidden = len(aux), spec.hidden_size
    dtype_bytes = dtype(store_dtype).bytes
    bytes_per_token = store_file_bytes(1, n_aux, hidden, store_dtype)[0]  # states (and their scales) per token
    overhead_per_token = sum(dtype(dt).bytes for _, dt in TOKEN_TENSORS)
    total_tokens = int(lengths.sum())
    header = _total_header_bytes(lengths, n_aux, hidden, store_dtype)
    hidden_bytes = total_tokens * bytes_per_token
    overhead = total_tokens * overhead_per_token + header
    total = hidden_bytes + overhead
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > max_seq_len:
        warnings.append(f"longest sample has {longest:,} tokens, more than max_seq_len {max_seq_len:,}")
    worst_tokens = len(lengths) * max_seq_len
    worst_lengths = np.full(len(lengths), max_seq_len, dtype=np.int64)  # [N]
    worst = worst_tokens * (bytes_per_token + overhead_per_token) + _total_header_bytes(
        worst_lengths, n_aux, hidden, store_dtype
    )

    free, checked_at, why = free_space(dest)
    if why:
        warnings.append(why)
    # exact integer arithmetic: a float product loses whole bytes beyond 2**53 (9 PB)
    required = total + math.ceil(total * Fraction(repr(cfg.disk_margin_fraction)))
    fits = None if free is None else required <= free

    weight_bytes = _weight_bytes(spec)
    if cfg.model_load_seconds is not None:
        load_s, load_src = cfg.model_load_seconds, "configured"
    elif weight_bytes is not None:
        load_s = weight_bytes / cfg.model_load_bytes_per_second
        load_src = f"{size(weight_bytes)} of weights at {cfg.model_load_bytes_per_second / 1e6:,.0f} MB/s"
    else:
        load_s, load_src = 0.0, "no safetensors weights found"
        warnings.append(f"no safetensors weights in {spec.path}: model load time counted as 0 s")
    extract_s = total_tokens / cfg.extraction_tokens_per_second

    plan = StorePlan(
        verifier=str(spec.path), aux_layer_ids=aux, hidden_size=hidden, num_hidden_layers=spec.num_hidden_layers,
        store_dtype=dtype(store_dtype).name, dtype_bytes=dtype_bytes, bytes_per_token=bytes_per_token,
        overhead_bytes_per_token=overhead_per_token, num_samples=len(lengths), total_tokens=total_tokens,
        longest_sample_tokens=longest, max_seq_len=max_seq_len, hidden_state_bytes=hidden_bytes,
        overhead_bytes=overhead, header_bytes=header, total_bytes=total, worst_case_tokens=worst_tokens,
        worst_case_bytes=worst, destination=os.fspath(dest), free_bytes=free, free_space_checked_at=checked_at,
        disk_margin_fraction=cfg.disk_margin_fraction, required_free_bytes=required, fits=fits,
        weight_bytes=weight_bytes, model_load_seconds=load_s, model_load_source=load_src,
        extraction_tokens_per_second=cfg.extraction_tokens_per_second, extraction_seconds=extract_s,
        estimated_seconds=load_s + extract_s, warnings=warnings,
    )
    if fits is False:
        message = (
            f"hidden-state store does not fit at {plan.destination} (filesystem of {checked_at}): needs "
            f"{_bytes(total)}, {_bytes(required)} with the {cfg.disk_margin_fraction:.0%} margin "
            f"(disk_margin_fraction), but only {_bytes(free)} are free"
        )
        if cfg.on_insufficient == "fail":
            raise CapacityError(message)
        plan.warnings.append(message)
    for line in plan.summary().splitlines():
        log.info("[capacity] %s", line)
    return plan


class VerifierLoad(BaseModel):
    """One load of the verifier in a run (an engine start, or the model loaded in-process)."""

    stage: str
    engine: Literal["vLLM", "transformers"]
    what: str


_SESSION_NAMES = {"A": "verifier + trained draft", "B": "verifier alone (baseline)", "U": "verifier + untrained draft"}


def verifier_loads(extract: ExtractConfig, regenerate: RegenerateConfig | None, regen_dtype: str | None,
                   validate: ValidateConfig | None) -> tuple[list[VerifierLoad], str | None]:
    """Every verifier load a run makes, stage by stage, and why validation's baseline cannot come from the
    regeneration's engine session (None: it does, eagle3.validate.baseline). vLLM restarts after an OOM and a
    cached stage's loads are not counted (they may not happen)."""
    regen_on = regenerate is not None and regenerate.enabled
    from eagle3.extract.stage import HiddenStates  # stage names: their artifacts' (late: extraction imports a lot)
    from eagle3.regenerate.stage import RegeneratedData
    from eagle3.validate.stage import ValidationReport

    loads = [VerifierLoad(stage=RegeneratedData.stage, engine="vLLM", what="generation")] if regen_on else []
    loads.append(VerifierLoad(stage=HiddenStates.stage, engine="vLLM" if extract.backend == "vllm" else
                              "transformers", what="hidden states"))
    problem = None
    if validate is not None:
        problem = reuse_problem(validate, regen_on, regen_dtype or "", regenerate.engine if regen_on else
                                validate.engine)
        loads += [VerifierLoad(stage=ValidationReport.stage, engine="vLLM", what=_SESSION_NAMES[letter])
                  for letter in validate.engine_sessions(baseline_shared=problem is None)]
        if validate.offline_reference:
            loads.append(VerifierLoad(stage=ValidationReport.stage, engine="transformers", what="offline reference"))
    return loads, problem


def loads_summary(loads: list[VerifierLoad], load_s: float, problem: str | None, validate: bool) -> str:
    """'verifier loads per run: 3 = regenerate 1 + ... (0:22:00 each, 1:06:00 in all); ...' for the plan."""
    per_stage: dict[str, list[str]] = {}
    for ld in loads:
        per_stage.setdefault(ld.stage, []).append(f"{ld.engine} {ld.what}")
    parts = " + ".join(f"{stage} {len(w)} ({', '.join(w)})" for stage, w in per_stage.items())
    line = (f"verifier loads per run: {len(loads)} = {parts}; {fmt_duration(load_s)} each, "
            f"{fmt_duration(load_s * len(loads))} (h:mm:ss) of loading in all")
    if validate:
        line += ("; validation's verifier-alone baseline comes from the regeneration's engine session" if problem
                 is None else f"; validation starts its own verifier-alone engine ({problem})")
    return line
class CapacityPlan(Artifact):
    """The capacity stage's output: the store's resolved layout (what extraction will write) and its plan."""

    stage: ClassVar[str] = "plan-capacity"

    plan_path: str = Field(description="plan.json: every figure of the StorePlan.")
    aux_layer_ids: list[int] = Field(description="Resolved aux layers, vLLM convention (id k = residual stream "
                                     "entering decoder layer k).")
    compute_dtype: str = Field(description="Resolved dtype extraction computes the verifier in.")
    store_dtype: str = Field(description="Resolved dtype of the stored states.")
    bytes_per_token: int = Field(description="Hidden-state bytes per token.")
    total_bytes: int = Field(description="Exact store size for this dataset, bytes.")
    required_free_bytes: int = Field(description="total_bytes plus the margin, bytes.")
    free_bytes: int | None = Field(description="Free bytes at the destination (None: unknown).")
    fits: bool | None = Field(description="required_free_bytes <= free_bytes (None: free space unknown).")
    estimated_seconds: float = Field(description="Regeneration (when on) + model load + extraction + training "
                                     "(when planned), seconds (an estimate).")
    training_seconds: float | None = Field(None, description="Training estimate (compute on nodes x nproc GPUs + "
                                           "the gradient all-reduce between hosts), seconds; None: not planned.")
    regeneration_seconds: float | None = Field(description="Regeneration estimate: one more verifier load + the "
                                               "upper bound of generated tokens at generation_tokens_per_second.")
    regeneration_tokens_upper: int | None = Field(description="Tokens regeneration generates at most (every turn "
                                                  "at max_new_tokens, each conversation cut at max_seq_len).")
    verifier_loads: list[VerifierLoad] = Field(default_factory=list, description="Every verifier load the run "
                                                "makes (engine starts and in-process loads), stage by stage.")
    verifier_load_seconds: float | None = Field(None, description="The time of those loads: their count x the "
                                                "model load estimate, seconds.")
    summary: str = Field(description="The plan in plain lines (the UI artifact and the log show it).")
    plan_sha256: str | None = Field(None, description="sha256 of plan.json as written (the reuse check; the "
                                    "fingerprint is the layout alone).")

    def outputs(self) -> list[str]:
        return [self.plan_path]

    def problems(self) -> list[str]:
        """Reuse check: plan.json's sha256 as written (a few KB)."""
        return [p for p in [file_problem(self.plan_path, sha256=self.plan_sha256)] if p]


def regenerated_lengths(prompt: np.ndarray, turns: np.ndarray, max_seq_len: int,
                        regenerate: RegenerateConfig) -> tuple[np.ndarray, int]:
    """Upper bounds before regeneration: every conversation's length in tokens (every assistant turn at
    max_new_tokens, cut at max_seq_len), each answer of answers_per_conversation its own conversation, and the
    tokens generated in all. ``prompt`` / ``turns``: per kept row, its tokens before the first answer and its
    assistant turns (``assistant_layout``)."""
    answers = regenerate.answers_per_conversation
    prompt, turns = np.repeat(prompt, answers), np.repeat(turns, answers)  # the answers of a row side by side
    lengths = np.minimum(max_seq_len, prompt + turns * regenerate.max_new_tokens)
    return lengths, int((lengths - np.minimum(prompt, lengths)).sum())


def plan_capacity(cfg: CapacityConfig, extract: ExtractConfig, verifier: VerifierIdentity, prepared: PreparedData,
                  dest: str | os.PathLike, out_dir: str | Path,
                  regenerate: RegenerateConfig | None = None, training: TrainingShape | None = None,
                  validate: ValidateConfig | None = None) -> CapacityPlan:
    """The capacity stage: resolve the store's layout with the rules extraction uses (aux layers, compute and store
    dtypes), plan it at ``dest`` and write ``<out_dir>/plan.json``. Raises CapacityError when it would not fit, and
    when vLLM on this host could not serve the ``draft`` kind beside this verifier (before anything is regenerated,
    extracted or trained: ``eagle3.draft.config.serving_pair_problem``).

    With ``regenerate`` enabled the answers are not known yet: the store is planned for the upper bound (every
    assistant turn at max_new_tokens, each conversation cut at max_seq_len), and the time adds the regeneration
    estimate (a verifier load + the generated tokens at generation_tokens_per_second). With ``training`` the time
    adds the training estimate on its nodes x nproc GPUs (``plan_training_time``), and the plan refuses a draft kind
    vLLM here could not serve beside the verifier, or a verifier layer the draft could not start from
    (``init_from_layer``). The plan counts every verifier load of the run
    (``verifier_loads``, with ``validate``'s engine sessions) and their time."""
    spec = verifier.spec()
    if training is not None and (problem := serving_pair_problem(spec.mla, training.draft.kind,
                                                                  device_type("auto"))):
        raise CapacityError(problem)
    aux = spec.resolve_aux_layer_ids(extract.aux_layer_ids)
    compute, store = extract.resolved_dtypes(spec)
    lengths: str | np.ndarray = prepared.dataset_path
    regen_s = regen_tokens = None
    if regenerate is not None and regenerate.enabled:
        lengths, regen_tokens = regenerated_lengths(*assistant_layout(prepared.dataset_path), prepared.max_seq_len,
                                                    regenerate)
    plan = plan_store(verifier.path, aux, store, lengths, dest, cfg, prepared.max_seq_len)
    summary = plan.summary()
    total_s = plan.estimated_seconds
    if regen_tokens is not None:
        regen_s = plan.model_load_seconds + regen_tokens / cfg.generation_tokens_per_second
        total_s += regen_s
        summary += (f"\n  regeneration first: at most {regen_tokens:,} generated tokens, "
                    f"{fmt_duration(regen_s)} (h:mm:ss) = a verifier load + generation at "
                    f"{cfg.generation_tokens_per_second:,.0f} tokens/s; the store above is planned for every "
                    f"answer at max_new_tokens ({regenerate.max_new_tokens:,} tokens)"
                    f"\n  total estimate: {fmt_duration(total_s)} (h:mm:ss)")
        for line in summary.splitlines()[-2:]:
            log.info("[capacity] %s", line)
    train_time = None
    if training is not None:
        try:
            train_time = plan_training_time(training, spec, aux, plan.num_samples, cfg)
        except DraftConfigError as e:  # train.draft, or a verifier layer train.init_from_layer cannot start from
            raise CapacityError(str(e)) from None
        total_s += train_time.seconds
        extra = [train_time.summary(training.epochs), f"  total estimate with training: {fmt_duration(total_s)}"]
        summary += "\n" + "\n".join(extra)
        for line in extra:
            log.info("[capacity] %s", line)
    regen_dtype = describe_compute_dtype(regenerate.dtype, spec.dtype, "auto") if regenerate is not None else None
    loads, problem = verifier_loads(extract, regenerate, regen_dtype, validate)
    load_line = loads_summary(loads, plan.model_load_seconds, problem, validate is not None)
    summary += f"\n  {load_line}"
    log.info("[capacity] %s", load_line)
    path = atomic_write_json(Path(out_dir) / PLAN_FILE, {**plan.model_dump(mode="json"),
                                                         "regeneration_seconds": regen_s,
                                                         "regeneration_tokens_upper": regen_tokens,
                                                         "training": train_time and train_time.model_dump(),
                                                         "verifier_loads": [ld.model_dump() for ld in loads],
                                                         "verifier_load_seconds": plan.model_load_seconds * len(loads),
                                                         "baseline_not_shared_because": problem})
    artifact = CapacityPlan(
        # identity = the layout extraction writes (never free space, paths or estimates: extraction keys on it,
        # and shards planned at different moments must fill one store)
        out_dir=str(out_dir), fingerprint=sha256_json({"aux_layer_ids": aux, "compute_dtype": compute,
                                                       "store_dtype": store, "hidden_size": plan.hidden_size}),
        plan_path=str(path), aux_layer_ids=aux,
        compute_dtype=compute, store_dtype=store, bytes_per_token=plan.bytes_per_token, total_bytes=plan.total_bytes,
        required_free_bytes=plan.required_free_bytes, free_bytes=plan.free_bytes, fits=plan.fits,
        estimated_seconds=total_s, regeneration_seconds=regen_s, regeneration_tokens_upper=regen_tokens,
        training_seconds=train_time and train_time.seconds, verifier_loads=loads,
        verifier_load_seconds=plan.model_load_seconds * len(loads), summary=summary, plan_sha256=sha256_file(path))
    artifact.save()
    return artifact

"""The extraction self-check: a sample extracted alone must equal the same sample extracted inside a full batch.

Pipeline position: part of **extract** (both backends run it in every extraction that writes samples). The states
a draft trains on must be the states the serving engine computes, whatever requests share its forward step. vLLM
0.32's CPU rotary kernel broke exactly that for MLA models with the default rope: states 1-5% off, depending on
which requests shared the step (token 0 exact). Nothing else in the pipeline would notice, so every extraction
compares one sample extracted in a batch of several with the same sample extracted alone, per stored state (each
aux layer, vLLM convention: id k = the residual stream entering decoder layer k, and the final pre-norm state),
and fails the stage naming the sample and the state when they differ beyond the compute dtype's tolerance.

    relative error of a state = ||batch - alone||_2 / ||alone||_2   over all of the sample's tokens

Tolerances (``TOLERANCE``): float32 1e-3 (what is left is summation order: ~1e-6 measured on the bundled and
Kimi-shaped verifiers); bfloat16 / float16 3e-2 (half-precision kernels round differently per batch shape). The
result is recorded in ``<store>/selfcheck.json`` (the stage's artifact carries it too); a failure stays recorded,
so a rerun that finds every sample stored fails the same way instead of training on suspect states.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("eagle3.extract")

# ``tokens_ahead`` of a batch copy whose place in its flattened step is not known: the step also continued requests
# scheduled in earlier steps, which the engine's persistent batch may put before, between or after the new ones
ORDER_UNKNOWN = -1

SELFCHECK_FILE = "selfcheck.json"
SELFCHECK_DIR = "selfcheck"  # the vLLM backend's alone-extracted sample files
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 3e-2}  # relative L2 error, by compute dtype


class BatchInvarianceError(ValueError):
    """The stored states depend on which samples shared the forward pass; the message names the sample and state."""


def tolerance(compute_dtype: str, override: float | None = None) -> float:
    """The relative L2 error allowed between a sample extracted alone and in a batch (``override`` wins)."""
    return override if override is not None else TOLERANCE[compute_dtype]


def state_names(aux_layer_ids: list[int]) -> list[str]:
    """The stored states in their order: one per aux layer (vLLM convention), then the final pre-norm state."""
    return [f"aux layer {k}" for k in aux_layer_ids] + ["final state (last layer's output, before the final norm)"]


def relative_errors(batch_aux: torch.Tensor, batch_final: torch.Tensor, alone_aux: torch.Tensor,
                    alone_final: torch.Tensor, n_aux: int) -> list[float]:
    """Relative L2 error per stored state. aux: [T, n_aux * H] (aux layers concatenated), final: [T, H]."""
    errors = []
    for a, b in zip((*batch_aux.float().chunk(n_aux, dim=-1), batch_final.float()),
                    (*alone_aux.float().chunk(n_aux, dim=-1), alone_final.float())):
        norm = float(b.norm())
        errors.append(float((a - b).norm()) / norm if norm > 0 else float((a - b).norm()))
    return errors


def check(index: int, batch_size: int, batch: tuple[torch.Tensor, torch.Tensor],
          alone: tuple[torch.Tensor, torch.Tensor], aux_layer_ids: list[int], compute_dtype: str, backend: str,
          seconds: float, limit: float | None = None, tokens_ahead: int | None = None) -> dict[str, Any]:
    """The self-check record of sample ``index`` (extracted in a forward pass holding ``batch_size`` samples, and
    alone): ``passed``, the error per state, the tolerance, and ``message`` naming the worst state when it failed.
    ``tokens_ahead``: in a flattened (unpadded) step, the step's tokens of the samples before this one (vLLM;
    ``ORDER_UNKNOWN`` when its place in the step is not known). Copies that differ beyond the tolerance fail
    whenever the step held other samples, wherever the copy sat. Copies that match pass only when the copy had
    samples before it: ``passed`` is None (inconclusive, ``reason`` says why) when the "batch" copy was computed
    alone (``batch_size`` < 2), first in its flattened step (``tokens_ahead`` 0) or at an unknown place, since a
    match there says nothing certain about batch dependence (vLLM's CPU rope bug left the first sample of a step
    exact)."""
    names = state_names(aux_layer_ids)
    errors = relative_errors(batch[0], batch[1], alone[0], alone[1], len(aux_layer_ids))
    tol = tolerance(compute_dtype, limit)
    worst = max(range(len(errors)), key=lambda i: errors[i])
    shared = batch_size > 1 and tokens_ahead not in (0, ORDER_UNKNOWN)
    within = all(math.isfinite(e) and e <= tol for e in errors)
    passed = False if batch_size > 1 and not within else (True if shared else None)
    record = {"ran": True, "passed": passed, "sample": index, "batch_samples": batch_size, "backend": backend,
              "compute_dtype": compute_dtype, "tolerance": tol, "seconds": round(seconds, 3),
              "relative_errors": dict(zip(names, errors)), "tokens": int(batch[1].shape[0])}
    if tokens_ahead is not None:
        record["tokens_ahead"] = tokens_ahead
    if passed is None:
        where = ("alone" if batch_size < 2 else f"at an unknown place among {batch_size} samples (the step also "
                 f"continued requests scheduled earlier)" if tokens_ahead == ORDER_UNKNOWN
                 else f"first of {batch_size} samples")
        record["reason"] = (
            f"the engine computed sample {index}'s batch copy {where} in its forward step, so the two copies say "
            f"nothing certain about batch dependence")
    elif not passed:
        record["message"] = (
            f"extraction self-check failed: sample {index} extracted alone differs from the same sample extracted in "
            f"a batch of {batch_size} samples at its {names[worst]}: relative L2 error {errors[worst]:.3g} > "
            f"{tol:g} (tolerance for {compute_dtype} compute, {backend} backend). The stored states depend on "
            f"which samples share a forward pass (a kernel bug of the engine; vLLM 0.32's CPU rotary kernel does "
            f"this for MLA models with the default rope), so the draft would train on states serving does not "
            f"compute. Use a configuration whose states are batch-independent (another backend, dtype or rope); "
            f"extract.selfcheck: false skips this check at your own risk")
    return record


def not_run(reason: str) -> dict[str, Any]:
    return {"ran": False, "passed": None, "reason": reason}


def save(store_dir: str | Path, record: dict[str, Any]) -> None:
    """Record the result in the store (a failure stays until the store is deleted)."""
    from eagle3.support.io import atomic_write_json  # stdlib + json only: safe in the vLLM interpreter

    atomic_write_json(Path(store_dir) / SELFCHECK_FILE, record)


def load(store_dir: str | Path) -> dict[str, Any] | None:
    path = Path(store_dir) / SELFCHECK_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def record(store_dir: str | Path, rec: dict[str, Any], stats: dict[str, Any]) -> None:
    """Save this run's result in the store and the run's stats, log it, and raise when it failed."""
    save(store_dir, rec)
    stats["selfcheck"] = rec
    {True: log.info, None: log.warning, False: log.error}[rec["passed"]]("extract: %s", summary(rec))
    raise_if_failed(rec)


def raise_if_failed(record: dict[str, Any] | None) -> None:
    if record is not None and record.get("passed") is False:
        raise BatchInvarianceError(record["message"])


def summary(record: dict[str, Any] | None) -> str:
    """One log line."""
    if record is None:
        return "self-check: not recorded"
    if not record.get("ran"):
        return f"self-check not run: {record['reason']}"
    if record["passed"] is None:
        return f"self-check inconclusive: {record['reason']}"
    worst = max(record["relative_errors"].items(), key=lambda kv: kv[1])
    return (f"self-check {'passed' if record['passed'] else 'FAILED'}: sample {record['sample']} alone vs in a batch "
            f"of {record['batch_samples']}: largest relative error {worst[1]:.2e} ({worst[0]}), tolerance "
            f"{record['tolerance']:g} ({record['compute_dtype']}), {record['seconds']:.2f} s")

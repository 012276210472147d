"""The train stage: hidden-state store + vocab mapping -> a vLLM-ready draft checkpoint (``DraftCheckpoint``).

Pipeline position: extract + vocab -> **train** -> validate. ``train_draft`` runs the ``Trainer``
(eagle3/train/trainer.py) in this process, or ``nproc`` workers through torch's elastic launch
(eagle3/train/launch.py), inside the device guard; ``run_local`` is one rank. With ``nodes > 1`` each host calls
``train_draft`` with its ``node_rank`` (the pipeline starts one Prefect flow run per host: tasks/nodes.py); node 0
writes every file and returns the checkpoint.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from eagle3.draft import checkpoint as ckpt
from eagle3.extract.stage import HiddenStates
from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.dtypes import device_type
from eagle3.support.gpu import DeviceGuard, cuda_device_ids, file_lock_guard
from eagle3.support.io import sha256_json
from eagle3.support.verifier import VerifierIdentity, describe_verifier
from eagle3.train.config import TrainConfig, TrainError
from eagle3.train.dist import Dist
from eagle3.train.trainer import run_local
from eagle3.vocab import VocabMapping

log = logging.getLogger("eagle3")


class DraftCheckpoint(Artifact):
    """The train stage's output: the best epoch's vLLM-ready checkpoint, its hashes, and how training went."""

    stage: ClassVar[str] = "train-draft"

    checkpoint_dir: str | None = Field(description="The best epoch's checkpoint folder (config.json + "
                                       "model.safetensors + eagle3_run.json); None when the run stopped before "
                                       "its first epoch ended.")
    weights_sha256: str | None = Field(description="sha256 of the checkpoint's model.safetensors, recorded at "
                                       "training: validation and the flow's summary compare it.")
    weights_bytes: int | None = Field(None, description="Byte size of the checkpoint's model.safetensors, recorded "
                                      "at training (the reuse check).")
    config_sha256: str | None = Field(description="sha256 of the checkpoint's config.json.")
    verifier: VerifierIdentity = Field(description="The verifier the draft was trained against.")
    aux_layer_ids: list[int] = Field(description="vLLM convention: id k = residual stream entering decoder layer k.")
    draft_vocab_size: int = Field(description="Draft vocabulary, tokens.")
    best_epoch: int | None = Field(description="Epoch of the best validation simulated acceptance length.")
    best_sim_accept_len: float | None = Field(description="That length (tokens per verifier step).")
    epoch_checkpoints: list[str] = Field(description="Epoch checkpoint folders kept (keep_last_n, plus best).")
    latest_state: str = Field(description="Resume state folder (weights, optimizer, RNG, counters).")
    metrics_path: str = Field(description="metrics.jsonl: one train record every log_every_steps, one val record "
                              "per epoch.")
    plots: list[str] = Field(description="loss / accuracy / acceptance PNG curves.")
    final_val: dict[str, Any] | None = Field(description="The last validation record (see metrics.jsonl).")
    untrained_val: dict[str, Any] | None = Field(description="Validation of the untrained draft (epoch 0).")
    epochs_done: int = Field(description="Epochs finished.")
    global_step: int = Field(description="Optimizer steps made.")
    total_steps: int = Field(description="Optimizer steps of the whole schedule.")
    tokens_seen: int = Field(description="Real (unpadded) tokens trained on.")
    packing_efficiency: float = Field(description="Real tokens / token slots of the packed training rows.")
    train_rows: int = Field(description="Packed training rows (sequences of max_seq_len tokens).")
    val_rows: int = Field(description="Packed validation rows.")
    truncated_samples: int = Field(description="Samples longer than max_seq_len, cut to it.")
    stopped_early: bool = Field(description="True when stop_after_steps ended this invocation before the schedule.")
    nproc: int = Field(description="Training processes, all nodes together.")
    nodes: int = Field(1, description="Hosts the run trained on (its last invocation).")
    wall_s: float = Field(description="Training wall time of this invocation, seconds.")

    def outputs(self) -> list[str]:
        return [p for p in (self.checkpoint_dir, self.metrics_path, self.latest_state) if p]

    def problems(self) -> list[str]:
        """Reuse check: model.safetensors has its recorded size and config.json its recorded sha256. The weights'
        own sha256 (GBs at Kimi size) is compared where they are used: validation and the flow's final summary."""
        if (missing := super().problems()) or not self.checkpoint_dir:
            return missing
        folder = Path(self.checkpoint_dir)
        checks = [file_problem(folder / ckpt.WEIGHTS, size=self.weights_bytes),
                  file_problem(folder / ckpt.CONFIG, sha256=self.config_sha256)]
        return [p for p in checks if p]


def train_draft(cfg: TrainConfig, store: HiddenStates | str | Path, vocab: VocabMapping | str | Path,
                out_dir: str | Path, *, verifier: VerifierIdentity | str | Path | None = None, resume: bool = True,
                guard: DeviceGuard | None = None, on_progress: Callable[[int, int, str], None] | None = None,
                node_rank: int = 0, local_addr: str | None = None) -> DraftCheckpoint | None:
    """Train a draft into ``out_dir`` (the train stage) and return its ``DraftCheckpoint``.

    ``store`` / ``vocab``: the upstream artifacts (or a store folder / mapping file); ``verifier``: the store
    artifact's when omitted (required with a plain store folder). ``resume`` continues from ``out_dir/latest``
    (a finished run returns at once); ``nproc > 1`` runs that many workers (gloo on CPU, nccl on CUDA).
    With ``cfg.nodes > 1`` this is node ``node_rank`` of the run (every host calls it, inside its own host's
    ``guard``; ``local_addr``: the address the other hosts reach this one at): each node first checks the artifacts
    it was handed against the files it sees, node 0 writes every file and returns the checkpoint, the other nodes
    return None.
    """
    if isinstance(verifier, (str, Path)):
        verifier = describe_verifier(verifier)
    verifier = verifier or (store.verifier if isinstance(store, HiddenStates) else None)
    if verifier is None:
        raise TrainError("train_draft: pass the verifier (a HiddenStates artifact carries it; a store folder does not)")
    if cfg.nodes > 1:
        _check_node_inputs(store, vocab, node_rank)
    store_dir = store.store_path if isinstance(store, HiddenStates) else str(store)
    vocab_path = vocab.mapping_path if isinstance(vocab, VocabMapping) else str(vocab)
    gpu_ids = cuda_device_ids(count=cfg.nproc) if device_type(cfg.device) == "cuda" else []
    with (guard or file_lock_guard(logger=log))(gpu_ids):
        if cfg.nodes > 1 or (cfg.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1):
            from eagle3.train.launch import launch

            result = launch(cfg, store_dir, vocab_path, verifier.path, out_dir, resume, node_rank, local_addr)
        else:
            result = run_local(cfg, store_dir, vocab_path, verifier.path, out_dir, resume, Dist.from_env(),
                               on_progress)
    if node_rank != 0:
        log.info("[train] node %d of %d done (%d optimizer steps; node 0 wrote the checkpoint)", node_rank, cfg.nodes,
                 result["global_step"])
        return None
    artifact = DraftCheckpoint(
        **result, verifier=verifier, nodes=cfg.nodes,
        fingerprint=sha256_json([result["weights_sha256"], result["config_sha256"], result["global_step"]]))
    artifact.save()
    return artifact


def _check_node_inputs(store: HiddenStates | str | Path, vocab: VocabMapping | str | Path, node_rank: int) -> None:
    """A node of a multi-node run checks the store and vocab it was handed against the files it sees (the reuse
    checks of a single host: sizes, the manifest's and the mapping's sha256): the run folder must be the same
    shared storage, at the same path, on every host."""
    problems = [*(store.problems() if isinstance(store, HiddenStates) else []),
                *(vocab.problems() if isinstance(vocab, VocabMapping) else [])]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise TrainError(f"node {node_rank} ({socket.gethostname()}) does not see the training inputs the pipeline "
                         f"recorded: {'; '.join(problems[:3])}{more}. Every host must mount the run folder at the "
                         f"same path")

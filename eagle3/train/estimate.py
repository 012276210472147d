"""The capacity plan's training part: what it reads of the train and vocab settings (``TrainingShape``), its time
estimate (``plan_training_time``; the formula is in eagle3.capacity's docstring) and the plan-time check of
``train.init_from_layer``. Re-exported by eagle3.capacity."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from eagle3.draft.config import DraftArchitecture, DraftConfig
from eagle3.support.progress import fmt_duration
from eagle3.support.verifier import VerifierSpec

if TYPE_CHECKING:
    from eagle3.capacity import CapacityConfig


class TrainingShape(BaseModel):
    """What the training time estimate reads of the train and vocab settings (the capacity stage is keyed on these,
    not on the whole training config: a new learning rate does not replan)."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(gt=0, description="Passes over the training split.")
    val_ratio: float = Field(ge=0, lt=1, description="Fraction of samples held out for validation.")
    batch_size: int = Field(gt=0, description="Packed sequences per optimizer step, all processes together.")
    nodes: int = Field(gt=0, description="Hosts training together.")
    nproc: int = Field(gt=0, description="Training processes (GPUs) per host.")
    draft_vocab_size: int = Field(gt=0, description="Draft vocabulary, tokens (configured; size_to_data: at most).")
    draft: DraftArchitecture = Field(description="The draft's architecture options (its parameter count).")
    init_from_layer: int | None = Field(None, description="train.init_from_layer: the verifier decoder layer the "
                                        "draft starts from (vLLM's id k; -1 = the last), checked at plan time.")


class TrainingTime(BaseModel):
    """Seconds (estimates) of one training run; see eagle3.capacity's docstring."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(description="nodes x nproc")
    nodes: int = Field(description="hosts training together")
    train_samples: int = Field(description="samples of the training split")
    trainable_parameters: int = Field(description="the draft's, count")
    compute_seconds: float = Field(description="epochs x train_samples x training_gpu_seconds_per_sample / gpus")
    optimizer_steps: int = Field(description="at least epochs x ceil(train_samples / batch_size)")
    allreduce_bytes_per_step: int = Field(description="bytes through each host's links per step (0 on one host)")
    network_seconds: float = Field(description="optimizer_steps x allreduce_bytes_per_step / "
                                   "internode_bytes_per_second")
    seconds: float = Field(description="compute_seconds + network_seconds")

    def summary(self, epochs: int) -> str:
        where = f"{self.nodes} hosts x {self.gpus // self.nodes} GPUs" if self.nodes > 1 else f"{self.gpus} GPU(s)"
        net = (f" + gradient all-reduce between hosts {fmt_duration(self.network_seconds)} ({self.optimizer_steps:,} "
               f"steps x {self.allreduce_bytes_per_step / 1e9:,.2f} GB per host)" if self.nodes > 1 else "")
        return (f"  training: {fmt_duration(self.seconds)} (h:mm:ss) on {where} = compute "
                f"{fmt_duration(self.compute_seconds)} ({epochs} epochs x {self.train_samples:,} samples){net}")


def plan_training_time(shape: TrainingShape, spec: VerifierSpec, aux_layer_ids: list[int], num_samples: int,
                       cfg: CapacityConfig) -> TrainingTime:
    """The training time estimate of ``shape`` over ``num_samples`` samples (see eagle3.capacity's docstring).
    Raises DraftConfigError, naming the field, where the draft could not start from the verifier layer
    ``shape.init_from_layer`` (``eagle3.draft.model.check_init_layer``: config.json, weight names and header shapes,
    no tensor data read), so that the capacity plan refuses a run before regeneration and extraction."""
    from eagle3.draft.model import check_init_layer
    from eagle3.train.memory import parameter_counts

    draft = DraftConfig.build(spec, shape.draft_vocab_size, aux_layer_ids, shape.draft)
    if shape.init_from_layer is not None:
        check_init_layer(draft, spec.path, shape.init_from_layer)
    trainable = sum(parameter_counts(draft)[0].values())
    gpus = shape.nodes * shape.nproc
    samples = num_samples - round(num_samples * shape.val_ratio)
    compute = shape.epochs * samples * cfg.training_gpu_seconds_per_sample / gpus
    steps = shape.epochs * math.ceil(samples / shape.batch_size)
    per_step = 0 if shape.nodes == 1 else math.ceil(2 * (shape.nodes - 1) / shape.nodes * 4 * trainable)
    network = steps * per_step / cfg.internode_bytes_per_second
    return TrainingTime(gpus=gpus, nodes=shape.nodes, train_samples=samples, trainable_parameters=trainable,
                        compute_seconds=compute, optimizer_steps=steps, allreduce_bytes_per_step=per_step,
                        network_seconds=network, seconds=compute + network)

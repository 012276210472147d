"""Settings of the train stage (one pydantic model; every field says its unit and whether it changes the output)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from eagle3.draft.config import DraftArchitecture
from eagle3.support.settings import RESUMABLE, RUNTIME, SETTINGS_MODEL


class TrainError(ValueError):
    """Bad training input (store, vocab mapping, verifier, settings); the message names the file / field."""


class TrainConfig(BaseModel):
    """Draft training settings (EAGLE-3 / SpecForge defaults where they exist)."""

    model_config = SETTINGS_MODEL

    epochs: int = Field(10, gt=0, description="Passes over the training split.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW; Muon: lr x muon_lr_scale), per optimizer "
                      "step.")
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="Learning-rate schedule after warmup: cosine decay to min_lr_ratio * lr, or constant.")
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="Linear warmup length as a fraction of all "
                                "optimizer steps of the run.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate of the cosine, as a fraction "
                                "of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay (per step, times lr).")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="'adamw': AdamW over every trainable parameter. 'muon': torch.optim.Muon over the "
        "draft's 2D weight matrices (fc, attention, MLP) and AdamW (lr, adam_betas, weight_decay) over norms and the "
        "draft lm_head, the split of speculators' default optimizer (eagle3.train.optim; refused with parallel "
        "fsdp). Muon's state is one momentum buffer per matrix instead of AdamW's two.")
    muon_lr_scale: float = Field(1.0, gt=0, description="optimizer 'muon': Muon's peak learning rate as a multiple "
                                 "of lr (same warmup and schedule), under torch's match_rms_adamw adjustment "
                                 "(update RMS 0.2 x its lr, AdamW-like); speculators 0.9: 1e-3 on both.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="optimizer 'muon': Muon's (Nesterov) momentum.")
    muon_weight_decay: float = Field(0.1, ge=0, description="optimizer 'muon': Muon's decoupled weight decay "
                                     "(per step, times its lr).")
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="optimizer 'muon': dtype of Muon's Newton-Schulz steps. 'auto' = bfloat16 (torch.optim."
        "Muon's own) on CUDA and on a CPU with native bf16 matmul, float32 elsewhere (eagle3.train.optim.Float32Muon: "
        "the same algorithm and state), where bf16 matmuls run ~20x slower than float32.")
    max_grad_norm: float = Field(0.5, gt=0, description="Gradient clipping: max global L2 norm (a large finite value "
                                 "such as 1e9 turns it off; inf is refused like every float setting).")
    batch_size: int = Field(8, gt=0, description="Packed sequences per optimizer step, over all processes and "
                            "accumulation micro-steps (the global batch). Must be a multiple of "
                            "nodes * nproc * grad_accum_steps.")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches per process per optimizer step.",
        json_schema_extra=RUNTIME)
    max_seq_len: int = Field(2048, gt=2, description="Packed sequence length in tokens; longer samples are "
                             "truncated to it.")
    ttt_steps: int = Field(7, gt=0, description="Training-time-test unroll depth K in draft steps (EAGLE-3: 7; "
                           "vLLM serving often drafts 3).")
    step_weight_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of TTT step k is this ** k.")
    loss: Literal["kl", "lk_alpha", "lk_lambda"] = Field(
        "kl", description="Per-token loss of each TTT step against the teacher distribution p (the verifier's, over "
        "the draft vocabulary) with the draft's q: 'kl' = forward KL(p || q) (EAGLE-3); the LK losses (Samarin et al., "
        "arXiv 2602.23881; SpecForge --lk-loss-type) aim at the acceptance rate alpha = sum_v min(p_v, q_v) itself: "
        "'lk_alpha' = -log(alpha), 'lk_lambda' = lam * KL + (1 - lam) * (1 - alpha) with lam = exp(-lk_eta * alpha) "
        "(alpha not differentiated there): mostly KL while the draft is poor, mostly acceptance once it is good.")
    lk_eta: float = Field(3.0, ge=0, description="'lk_lambda' loss: how fast the KL weight falls with the acceptance "
                          "rate alpha (a fraction), lam = exp(-lk_eta * alpha); 0 = pure KL.")
    feature_noise: float = Field(
        0.0, ge=0, description="Uniform noise U(-x, x) added to the aux hidden states (fc's input) of every training "
        "micro-batch, in the states' own units; never to validation. An augmentation against memorizing the stored "
        "states: EAGLE-1/2 train with uniform noise on the features; speculators' trainer after 0.9.0 adds U(-0.05, "
        "0.05) by default (--noise-std; 0.9.0 has none). Seeded by (seed, optimizer step, process, micro-batch): a "
        "resumed run adds the same noise. 0 = none.")
    max_samples: int | None = Field(
        None, gt=0, description="Train (and validate) on the store's first N samples only, in its sample order (the "
        "prepared data's order); None = all. One extraction then serves runs at several data sizes.")
    val_ratio: float = Field(0.05, ge=0, lt=1, description="Fraction of samples held out for validation "
                             "(deterministic in seed).")
    seed: int = Field(0, description="Seed of the draft init, split and per-epoch batch order.")
    init_from_layer: int | None = Field(
        None, description="Start the draft's decoder layer as the verifier's decoder layer k (vLLM's layer id: "
        "the layer whose input is the residual stream k; negative counts from the last, -1 = the last): its norms, "
        "o_proj and MLP, and its q/k/v as the half of the draft's q/k/v that reads the hidden state (the embedding "
        "half keeps the seeded init). Llama draft kind at the verifier's widths; the capacity plan checks the "
        "verifier's layer (config.json and weight names) before anything is regenerated or extracted. None = seeded "
        "random layer (EAGLE-3).")
    keep_last_n: int = Field(2, ge=0, description="Epoch checkpoints kept besides `best` (0 = keep all).",
        json_schema_extra=RUNTIME)
    save_state_every_steps: int = Field(0, ge=0, description="Also write the resume state every this many "
                                        "optimizer steps inside an epoch (0 = only at epoch ends).",
        json_schema_extra=RUNTIME)
    save_state_every_minutes: float = Field(10.0, ge=0, description="Also write the resume state inside an epoch "
                                            "once this many minutes of training have passed since the last save, "
                                            "so a kill loses minutes, not an epoch (0 = off). One save writes the "
                                            "fp32 weights and optimizer moments: 12 bytes per trainable parameter "
                                            "with AdamW (8 for Muon's matrices); its "
                                            "time is logged (docs/DESIGN.md, 'Resume').",
        json_schema_extra=RUNTIME)
    stop_after_steps: int | None = Field(None, gt=0, description="End this invocation once the run has made this "
                                         "many optimizer steps in total, saving the resume state (time-boxed "
                                         "jobs); the schedule still spans all epochs. None = run to the end.",
        json_schema_extra=RESUMABLE)
    eval_before_training: bool = Field(True, description="Validate the untrained draft first (epoch 0 in the "
                                       "metrics) as a baseline.")
    log_every_steps: int = Field(10, gt=0, description="One progress line + one metrics.jsonl line every this "
                                 "many optimizer steps.",
        json_schema_extra=RUNTIME)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu. "
                                                   "bf16 autocast on cuda; on cpu: cpu_dtype.",
        json_schema_extra=RUNTIME)
    cpu_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="Compute dtype of training on a CPU (CUDA always uses bf16 autocast): float32 "
        "(bit-reproducible: the pinned loss trajectory, offline-vs-vLLM parity), bfloat16 (autocast: matmuls in "
        "bf16, weights, optimizer states and the teacher in float32), or auto = bfloat16 when this CPU multiplies "
        "bf16 natively (AVX512-BF16 / AMX, eagle3.support.dtypes), else float32. Measured on the project's AVX512-BF16 "
        "EPYC: a bf16 matmul of the draft's lm_head shape 2.2x faster than float32; without native bf16 ~20x "
        "slower.")
    nproc: int = Field(1, gt=0, description="Training processes per node (one per GPU on cuda; started by torch's "
                       "elastic launcher, the engine of torchrun). The run has nodes x nproc processes in all.",
        json_schema_extra=RUNTIME)
    nodes: int = Field(1, gt=0, description="Hosts (nodes) that train this run together, each running nproc "
                       "processes under its own torch elastic agent; they meet at rdzv_endpoint. 1 = this host "
                       "alone. The global batch is split over all nodes x nproc processes, so the same settings give "
                       "the same run on any number of nodes (docs/DESIGN.md, 'Multi-node training').",
        json_schema_extra=RUNTIME)
    rdzv_endpoint: str | None = Field(None, description="With nodes > 1: host:port of the rendezvous. With "
                                      "rdzv_backend c10d, node 0's address and a TCP port free there that every "
                                      "node reaches (node 0's agent serves the rendezvous store on it; e.g. "
                                      "gpu-host-a:29400); with etcd-v2, the endpoint of an etcd server you run.",
        json_schema_extra=RUNTIME)
    rdzv_backend: Literal["c10d", "etcd-v2"] = Field("c10d", description="torch elastic's rendezvous backend: "
                                                     "c10d (node 0 hosts it, nothing else to run) or etcd-v2 (an "
                                                     "etcd server you run; needs the python-etcd package).",
        json_schema_extra=RUNTIME)
    rdzv_id: str | None = Field(None, description="Run id of the rendezvous: every node of one launch uses the same "
                                "and no other launch on the same endpoint does. None = a new id per launch (the "
                                "pipeline makes one and hands it to every node).",
        json_schema_extra=RUNTIME)
    join_timeout_seconds: float = Field(600.0, gt=0, description="Seconds the rendezvous waits for every node to "
                                        "join (at the start and after a restart); a node missing then fails the "
                                        "launch naming it. Nodes join after taking their host's GPU guard.",
        json_schema_extra=RUNTIME)
    max_restarts: int = Field(0, ge=0, description="Times torch elastic restarts every node's workers after a "
                              "worker dies (kill -9, a lost peer) before the launch fails; each restart resumes "
                              "from latest/, losing what was trained since the last resume state "
                              "(save_state_every_minutes). Applies to launched workers (nproc > 1 or nodes > 1).",
        json_schema_extra=RUNTIME)
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="With nproc > 1: ddp replicates the draft; fsdp "
                                             "shards it (drafts too big for one GPU).",
        json_schema_extra=RUNTIME)
    draft: DraftArchitecture = Field(default_factory=DraftArchitecture, description="Draft architecture options.")
    checkpoint_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="dtype of the saved draft weights (None: the verifier's dtype).")
    save_embedding: bool = Field(False, description="Also save embed_tokens.weight in model.safetensors (vLLM "
                                 "shares the verifier's embedding when it is absent; Kimi: 2.3 GB saved).")
    loader_workers: int = Field(1, ge=0, description="Loader threads that read and collate the next optimizer "
                                "steps' batches while the current one computes, 2 steps each in flight (0 = load "
                                "on demand in the training loop).",
        json_schema_extra=RUNTIME)
    on_insufficient_memory: Literal["fail", "warn"] = Field(
        "fail", description="When the training memory plan (eagle3.train.memory: parameters, gradients, optimizer "
        "states, activations, teacher buffers, batches; bytes per process) plus memory_margin_fraction exceeds the "
        "GPU's free memory (CUDA) or the host's available RAM (CPU, all processes): 'fail' refuses to start with "
        "the itemized plan, 'warn' logs it and tries anyway.", json_schema_extra=RUNTIME)
    memory_margin_fraction: float = Field(
        0.10, ge=0, description="Memory required on top of the plan's peak, as a fraction of it (allocator slack, "
        "the CUDA context, the Python runtime).", json_schema_extra=RUNTIME)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rdzv_endpoint {value!r}: expected host:port with a port in 1-65535 (e.g. "
                             f"gpu-host-a:29400)")
        return value.strip()

    @model_validator(mode="after")
    def _multi_node(self) -> TrainConfig:
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"rdzv_endpoint is required with nodes {self.nodes} > 1: host:port of node 0 where "
                             f"the rendezvous listens (e.g. gpu-host-a:29400)")
        return self

    @model_validator(mode="after")
    def _init_layer_needs_llama(self) -> TrainConfig:
        if self.init_from_layer is not None and self.draft.kind != "llama":
            raise ValueError(f"init_from_layer {self.init_from_layer} with draft.kind {self.draft.kind!r}: starting "
                             f"from a verifier layer is implemented for the llama draft kind only")
        return self

    @model_validator(mode="after")
    def _muon_not_sharded(self) -> TrainConfig:
        if self.optimizer == "muon" and self.parallel == "fsdp":
            raise ValueError("optimizer 'muon' with parallel 'fsdp': not verified (over FSDP's shards two gloo "
                             "processes ended 5e-4 from one process after 8 steps, where DDP + Muon and FSDP + AdamW "
                             "agree within 1e-5); use parallel 'ddp' or optimizer 'adamw'")
        return self

    @property
    def world_size(self) -> int:
        """Training processes of the run, all nodes together."""
        return self.nodes * self.nproc

    def world_problem(self) -> str | None:
        """Why batch_size does not split over the run's processes and micro-steps (None: it does)."""
        if self.batch_size % (self.world_size * self.grad_accum_steps):
            return (f"batch_size {self.batch_size} (packed sequences per optimizer step) is not a multiple of nodes "
                    f"{self.nodes} x nproc {self.nproc} x grad_accum_steps {self.grad_accum_steps}")
        return None

    def with_smaller_micro_batches(self, scale: float) -> TrainConfig:
        """The same run at ``scale`` (1/2, 1/4, ...) of the micro-batch, for an out-of-memory retry: grad_accum_steps
        doubled per halving while it stays a divisor of the per-process batch (the global batch, hence the run, is
        unchanged: grad_accum_steps is a runtime setting)."""
        per_step = self.batch_size // self.world_size  # packed sequences per process per optimizer step
        accum = self.grad_accum_steps
        while accum < self.grad_accum_steps / scale and per_step % (accum * 2) == 0:
            accum *= 2
        return self.model_copy(update={"grad_accum_steps": accum})

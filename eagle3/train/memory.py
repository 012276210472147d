"""Training memory plan: the bytes one training process holds on its device at its peak, before anything is built.

Pipeline position: store + vocab -> **memory plan** (``Trainer.setup``, before the draft is allocated) -> train.
Like the capacity plan of extraction: every figure is computed from the draft's shape (``DraftConfig``) and the
batch settings (``TrainConfig``), itemized, logged, and compared with the device's free memory (CUDA:
``torch.cuda.mem_get_info``; CPU: psutil's available RAM, shared by all ranks of the host) with a margin; a plan that
does not fit refuses to start (``on_insufficient_memory: fail``) or warns.

What is counted, per training process (one per GPU), for a micro-batch of B = batch_size / (W * grad_accum)
(W = nodes * nproc processes in all; FSDP shards over all W; on CPU the nproc processes of one host share its RAM)
packed rows padded to T = max_seq_len tokens (N = B * T), draft vocab D, K TTT steps, hidden H, MLP width I, heads
nh / KV heads nkv of head_dim hd; c = compute bytes (2: bf16 autocast on CUDA, 4: float32 on CPU); a = 4 (float32)::

    parameters     trainable (fc, midlayer, norm, lm_head) + frozen embedding (vocab x H), float32; buffers
                   d2t / t2d; the teacher head (final norm + D lm_head rows, float32)
    gradients      trainable, float32; DDP (nproc > 1) keeps a bucket copy of them (gradient_as_bucket_view off)
    AdamW          exp_avg + exp_avg_sq, float32 (2 x trainable), and one trainable-sized temporary in step();
                   optimizer "muon": one momentum buffer for the weight matrices, AdamW's two for the rest
    FSDP           parameters, gradients and AdamW states / nproc, plus the unsharded parameters gathered for
                   compute (all groups at once, worst case) and one group's unsharded gradients before reduce-scatter
    activations    what autograd keeps until backward, per TTT step k (context S_k = (k + 1) T). The layer runs at
                   the step's kept entries, at most R_k = B (T - 2 - k) rounded up to a multiple of 64 rows (those
                   whose guess lies inside the row: eagle3.train.ttt, eagle3.draft.model.Rows), except step 0's
                   inputs, keys and values (all N); N_k = N at step 0, R_k later; the attention's q/k/v, scores and
                   cache live on the [B, T] grid (N):
                     RMSNorms: input_layernorm a N_k H; hidden_norm (N_k), post_attention_layernorm and norm (R_k)
                       (inputs that need grad): (a + c) H each per entry on CUDA (a float32 copy of the input + the
                       normed output cast back), 2 a H on CPU (the input itself + the normed output)
                     q/k/v input [N_k, 2H] (+ step 0's gathered query input [R_0, 2H]): once per projection on CUDA
                       (autocast's casts), once on CPU
                     q after RoPE c N nh hd; o_proj's input, the attention output gathered, c R_k nh hd (SDPA on CUDA
                       also keeps its whole output c N nh hd); RoPE cos/sin
                     K/V: the step's k, v (in the cache) 2 c N nkv hd. CUDA (SDPA's fused kernels): from step 1 on
                       the concatenation of all steps' keys and values 2 c B S_k nkv hd (repeated to nh heads for
                       GQA, every step); the additive mask c B T S_k; log-sum-exp a B nh T. CPU (the attention
                       written out, eagle3.draft.model._explicit_attention): q scaled (in place of q after RoPE),
                       the probabilities a B nh T (T + k), the inverted context mask B T T bytes, and under GQA
                       every step's keys and values repeated to nh heads 2 a B T nh hd (k + 1); without GQA it
                       keeps the cache itself
                     MLA draft (kind mla): q/kv latents with their RMSNorms (input, normed values, statistics;
                       q at R_k, kv at N_k; the kv latent views its [.., kv_lora_rank + rope] projection), RoPE
                       over the rope part only; keys are qk_nope + qk_rope wide, values v_head_dim
                     MLP at R_k: gate/up inputs (2 c R_k H on CUDA, a R_k H on CPU) + gate, silu, up, product
                       4 c R_k I
                     the heads at R_k: lm_head input c R_k H; log-softmax of the draft logits a R_k D (the LK losses:
                       + the gathered teacher probabilities and q, 2 a R_k D); the gather indices
                   plus fc's input (CUDA: the bf16 cast of the aux states, c N n_aux H_t; CPU: a float32 copy of a
                   bf16 batch; with train.feature_noise the float32 noised states, 4 N n_aux H_t, on either) and
                   the norms before fc (norm_before_fc / fc_norm), autocast's bf16 copies of the trainable matmul
                   weights (CUDA), the teacher probabilities a R_0 D (the teacher runs at
                   the rows some kept entry reads, at most R_0; alive through the unroll and read again by the
                   KL's backward), and the last step's transients (its logits or their gradient c R_{K-1} D + the
                   KL's float32 buffers 2 a R_{K-1} D). The peak is at the end of the forward's last step or the start
                   of its backward.
    batch          the micro-batch on the device: aux [N, n_aux H_t] + final [N, H] in the batch dtype, ids/masks;
                   on CPU the whole optimizer step's micro-batches plus the loader's prefetch (2 steps per thread)

    peak = parameters + buffers + teacher head + optimizer states + gradients (+ DDP buckets)
           + max(activations + batch, optimizer step temporary)

Not counted: the CUDA context and allocator slack (the margin covers them), the Python/torch runtime of each process
(~0.3 GB RSS per training process on CPU), validation (no autograd: smaller than training).
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from eagle3.draft.config import DraftConfig
from eagle3.support.dtypes import device_type
from eagle3.train.config import TrainConfig, TrainError
from eagle3.train.ttt import HEAD_ROWS_BUCKET

log = logging.getLogger("eagle3")

F32 = 4  # bytes: master weights, gradients, AdamW states, norms' statistics, softmaxes


class TrainMemoryError(TrainError):
    """The training memory plan does not fit the device; the message gives the itemized numbers."""


class MemoryItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    bytes: int
    detail: str


class MemoryPlan(BaseModel):
    """Bytes per training process (one per GPU) at its peak, itemized. All sizes in bytes."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda"]
    parallel: str = Field(description="'single', 'ddp' or 'fsdp'")
    processes: int = Field(description="training processes of the run, all nodes together (nodes x nproc)")
    processes_per_host: int = Field(description="training processes on one host (nproc); on CPU they share its RAM")
    micro_batch_rows: int = Field(description="packed rows per micro-batch per process")
    tokens_per_micro_batch: int = Field(description="micro_batch_rows x max_seq_len (rows padded to max_seq_len)")
    ttt_steps: int
    trainable_parameters: int = Field(description="count, not bytes")
    frozen_parameters: int = Field(description="count, not bytes (the verifier's embedding)")
    items: list[MemoryItem] = Field(description="the pieces of the peak, in bytes")
    static_bytes: int = Field(description="parameters, buffers, teacher head, gradients, optimizer states")
    activation_bytes: int = Field(description="autograd-saved tensors + teacher buffers + last-step transients")
    activations: dict[str, int] = Field(description="activation_bytes by kind, bytes")
    batch_bytes: int = Field(description="input batches resident with the activations")
    optimizer_step_bytes: int = Field(description="the optimizer's temporary during step() (activations are freed "
                                      "then)")
    peak_bytes: int = Field(description="static + max(activations + batch, optimizer step temporary)")

    def summary(self) -> str:
        hosts = -(-self.processes // self.processes_per_host)
        where = f" on {hosts} hosts of {self.processes_per_host}" if hosts > 1 else ""
        lines = [(f"Training memory plan per {'GPU' if self.device == 'cuda' else 'process'} ({self.parallel}, "
                 f"{self.processes} process(es){where}, {self.device}): micro-batch {self.micro_batch_rows} rows x "
                 f"{self.tokens_per_micro_batch // max(1, self.micro_batch_rows):,} tokens, {self.ttt_steps} TTT "
                 f"steps; {self.trainable_parameters / 1e6:,.1f}M trainable + {self.frozen_parameters / 1e6:,.1f}M "
                 f"frozen parameters")]
        lines += [f"  {i.name:<28} {_gb(i.bytes):>10}  {i.detail}" for i in self.items]
        lines.append(f"  {'peak':<28} {_gb(self.peak_bytes):>10}  = static {_gb(self.static_bytes)} + "
                     f"max(activations {_gb(self.activation_bytes)} + batch {_gb(self.batch_bytes)}, optimizer step "
                     f"{_gb(self.optimizer_step_bytes)})")
        return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB"


def parameter_counts(d: DraftConfig) -> tuple[dict[str, int], int]:
    """(trainable parameter counts by module, frozen embedding count) of ``eagle3.draft.model.Eagle3Draft``."""
    h = d.hidden_size
    trainable = {
        "fc": d.n_aux * d.target_hidden_size * h,
        "attention": d.attention_params(),  # q/k/v (llama) or the latent projections and norms (mla); o_proj
        "mlp": 3 * h * d.intermediate_size,
        "norms": 4 * h + d.fc_norm_params(),  # input_layernorm, hidden_norm, post_attention_layernorm, norm (+ fc's)
        "lm_head": d.draft_vocab_size * h,
    }
    return trainable, d.vocab_size * h


def _step_activations(d: DraftConfig, b: int, t: int, k: int, c: int, cuda: bool, loss: str) -> dict[str, int]:
    """Bytes autograd keeps for TTT step ``k`` of a [b, t] micro-batch (see the module docstring). The layer runs at
    the step's kept entries (eagle3.train.ttt: r = ``head_rows`` at most) except step 0's inputs, keys and values,
    which cover all n = b t entries; the attention's queries, keys and values live on the [b, t] grid."""
    n, h, i_ = b * t, d.hidden_size, d.intermediate_size
    r = head_rows(b, t, k)
    ne = n if k == 0 else r  # entries of the layer's inputs: step 0 every entry, later steps a gathered copy
    grad_norm = (lambda m: (F32 + c) * m * h) if cuda else (lambda m: 2 * F32 * m * h)  # an RMSNorm, input w/ grad
    return {
        # input_layernorm (input needs no grad) and hidden_norm at the inputs' entries, post_attention_layernorm and
        # the final norm at the kept ones, + the rsqrt statistics [.., 1] of the 3 whose input needs grad
        "norms": F32 * ne * h + grad_norm(ne) + 2 * grad_norm(r) + F32 * (ne + 2 * r),
        **_attention_activations(d, b, t, k, c, cuda),
        "mlp": (2 * c * r * h if cuda else F32 * r * h) + 4 * c * r * i_,
        # the heads' input (the final norm's output at the kept entries) + the kept entries' index (every gather of
        # the step), the teacher rows' index (GatheredKL) and the counted mask; from step 1 on the index of the
        # previous step's outputs that the hidden inputs gather
        "lm_head input": c * r * h + (17 if k == 0 else 25) * r,
        "log-softmax": F32 * r * d.draft_vocab_size,
        # the LK losses keep the gathered teacher probabilities and q (the KL's GatheredKL keeps neither)
        "teacher rows": 2 * F32 * r * d.draft_vocab_size if loss != "kl" else 0,
    }


def head_rows(b: int, t: int, k: int) -> int:
    """The most entries TTT step ``k`` keeps in a [b, t] micro-batch (its layer and heads run there): entry i
    guesses x_{i+2+k}, which must lie in the row (eagle3.train.ttt.ttt_kept), padded to a multiple of
    HEAD_ROWS_BUCKET (``padded_rows``)."""
    n = b * max(0, t - 2 - k)
    return -(-n // HEAD_ROWS_BUCKET) * HEAD_ROWS_BUCKET


def _attention_activations(d: DraftConfig, b: int, t: int, k: int, c: int, cuda: bool) -> dict[str, int]:
    """The attention's share of ``_step_activations``: its input (step 0: [N, 2H] for the keys/values + the kept
    entries' gathered copy for the queries; later steps: the kept entries' [R, 2H]), q and the output, RoPE tables,
    this step's keys/values, the copies of keys/values the attention keeps, the mask and probabilities; MLA adds its
    latent norms (the q and kv latents, each RMSNorm's input, normed output and statistics; the kv latent is a view
    of the [.., kv_lora_rank + rope] projection, whose whole storage stays)."""
    n, h, nh = b * t, d.hidden_size, d.num_attention_heads
    r = head_rows(b, t, k)
    ne = n if k == 0 else r  # the keys'/values' projection input
    s = (k + 1) * t  # keys the step attends over: the context (step 0) + its own earlier steps
    qk, vd = d.head_dim, d.value_head_dim
    if d.kind == "mla":
        kv_heads, rope = nh, d.qk_rope_head_dim
        projections = 2  # q_a_proj (or q_proj) and kv_a_proj_with_mqa read the same input
        q_latent = (F32 + 2 * c if cuda else 3 * F32) * r * d.q_lora_rank + F32 * r if d.q_lora_rank else 0
        kv_latent = ((F32 + 2 * c) * ne * d.kv_lora_rank if cuda else
                     F32 * ne * (d.kv_lora_rank + rope) + 2 * F32 * ne * d.kv_lora_rank) + F32 * ne
        latents = {"mla latents": q_latent + kv_latent}
    else:
        kv_heads, rope, projections, latents = d.num_key_value_heads, qk, 3, {}
    if cuda:  # autocast casts the input once per projection: the queries' one at the kept entries
        attention_input = (projections - 1) * c * ne * 2 * h + c * r * 2 * h
    else:  # the float32 input itself (shared by the projections that read it) + step 0's gathered query input
        attention_input = F32 * ne * 2 * h + (F32 * r * 2 * h if k == 0 else 0)
    out = {
        "attention input": attention_input,
        **latents,
        # q after RoPE on the grid + o_proj's input, the attention output gathered at the kept entries (SDPA on CUDA
        # also keeps its whole output) + RoPE cos/sin
        "attention q/out": c * n * nh * qk + c * r * nh * vd + (c * n * nh * vd if cuda else 0)
        + (4 * c if cuda else 2 * F32) * n * rope,
        "k/v cache": c * n * kv_heads * (qk + vd),
    }
    if not cuda:
        # eagle3.draft.model._explicit_attention: q scaled (counted above), the probabilities [B, heads, T, T + k],
        # the inverted context mask, and every step's keys/values repeated to each query head under GQA (without
        # GQA it keeps the cache itself: cache_kept_by_attention)
        out["k/v copies"] = F32 * b * t * nh * (qk + vd) * (k + 1) if kv_heads != nh else 0
        out["attention mask"] = F32 * b * nh * t * (t + k) + b * t * t
        return out
    repeat = nh if kv_heads != nh else kv_heads  # GQA: SDPA keeps the keys repeated to every query head
    # step 0 without GQA: SDPA keeps the cache itself
    out["k/v copies"] = c * b * s * repeat * (qk + vd) if (k > 0 or kv_heads != nh) else 0
    out["attention mask"] = c * b * t * s + F32 * b * nh * t  # additive mask + log-sum-exp
    return out


def cache_kept_by_attention(d: DraftConfig, micro_rows: int, seq_len: int, ttt_steps: int,
                            device: Literal["cpu", "cuda"]) -> int:
    """Bytes of the keys/values cache (counted under "k/v cache") that the attention keeps for backward itself.
    Without GQA (MLA included) a CPU's written-out attention keeps every step's keys and values, and SDPA's fused
    kernels on CUDA step 0's; under GQA both keep repeated copies instead (counted apart)."""
    n = micro_rows * seq_len
    if device == "cpu":
        kv_heads = d.num_attention_heads if d.kind == "mla" else d.num_key_value_heads
        return ttt_steps * F32 * n * kv_heads * (d.head_dim + d.value_head_dim) if kv_heads == d.num_attention_heads \
            else 0
    if d.num_key_value_heads == d.num_attention_heads:
        return 2 * n * d.num_key_value_heads * (d.head_dim + d.value_head_dim)
    return 0


def plan_training_memory(draft: DraftConfig, cfg: TrainConfig, world: int | None = None,
                         device: Literal["cpu", "cuda"] | None = None, batch_dtype_bytes: int | None = None,
                         micro_rows: int | None = None, autocast: bool | None = None) -> MemoryPlan:
    """The plan for ``draft`` trained with ``cfg`` by ``world`` processes (default nodes x nproc) on ``device``
    (default: cfg.device, auto = cuda when available). ``batch_dtype_bytes``: bytes per stored state value in the
    batches (default: 2 on CUDA, 4 on CPU; a float8 store's states arrive dequantized to the compute dtype);
    ``micro_rows``: rows per micro-batch (default batch_size / (world * grad_accum_steps)); ``autocast``: bf16
    autocast (default: on CUDA only; a CPU's bf16 autocast, train.cpu_dtype, is planned as float32 activations, an
    upper bound, plus autocast's bf16 weight copies)."""
    world = world or cfg.world_size
    if device is None:
        device = device_type(cfg.device)
    cuda = device == "cuda"
    c = 2 if cuda else F32  # bf16 autocast on CUDA, float32 on CPU (eagle3.train.trainer)
    sb = batch_dtype_bytes or c
    b = micro_rows or max(1, cfg.batch_size // (world * cfg.grad_accum_steps))
    t, kk = cfg.max_seq_len, cfg.ttt_steps
    n, h, dv = b * t, draft.hidden_size, draft.draft_vocab_size
    parallel = "single" if world == 1 else cfg.parallel
    counts, frozen = parameter_counts(draft)
    trainable = sum(counts.values())
    matmul = trainable - counts["norms"]
    shard = world if parallel == "fsdp" else 1

    items: list[tuple[str, int, str]] = []
    params = F32 * (trainable + frozen)
    items.append(("parameters", math.ceil(params / shard),
                  f"{trainable / 1e6:,.1f}M trainable + {frozen / 1e6:,.1f}M frozen embedding, float32"
                  + (f", sharded over {world}" if shard > 1 else "")))
    buffers = 8 * dv + draft.vocab_size + F32 * (dv * h + h)
    items.append(("buffers + teacher head", buffers, (f"d2t/t2d + the verifier's final norm and {dv:,} lm_head "
                  f"rows, float32")))
    grads = math.ceil(F32 * trainable / shard)
    items.append(("gradients", grads, "float32" + (f", sharded over {world}" if shard > 1 else "")))
    if parallel == "ddp":
        items.append(("DDP gradient buckets", F32 * trainable, "a copy of the gradients for the all-reduce"))
    if cfg.optimizer == "muon":  # eagle3.train.optim: Muon over fc / attention / MLP matrices, AdamW over the rest
        latent_norms = ((draft.q_lora_rank or 0) + draft.kv_lora_rank) if draft.kind == "mla" else 0  # AdamW's
        matrices = counts["fc"] + counts["attention"] - latent_norms + counts["mlp"]
        items.append(("Muon momentum", math.ceil(F32 * matrices / shard), "one buffer per weight matrix, float32"))
        items.append(("AdamW states", math.ceil(2 * F32 * (trainable - matrices) / shard),
                      "exp_avg + exp_avg_sq of norms and lm_head, float32"))
    else:
        items.append(("AdamW states", 2 * grads, "exp_avg + exp_avg_sq, float32"))
    if parallel == "fsdp":
        items.append(("FSDP unsharded parameters", params, ("all-gathered for forward/backward (worst case: "
                      "every group at once)")))
        items.append(("FSDP unsharded gradients", F32 * max(counts["fc"] + counts["lm_head"],
                                                            counts["attention"] + counts["mlp"]),
                      "the largest group's gradients before reduce-scatter"))
    static = sum(x[1] for x in items)

    steps = [_step_activations(draft, b, t, k, c, cuda, cfg.loss) for k in range(kk)]
    act: dict[str, int] = {key: sum(s[key] for s in steps) for key in steps[0]}
    # fc's input: CUDA keeps autocast's bf16 cast of it; CPU the float32 batch tensor itself (counted in the batch),
    # or the float32 copy of a bf16/fp16 batch (aux.float()). train.feature_noise makes that float32 copy whatever
    # the batch dtype (eagle3.train.data.noised_aux), alive through the step: the float copy it replaces, if any.
    width = draft.n_aux * draft.target_hidden_size  # fc's input
    noised = cfg.feature_noise > 0
    norms = int(draft.norm_before_fc) + int(draft.fc_norm)
    if norms:  # norm_before_fc / fc_norm: the first norm keeps the float32 batch copy, not autocast's cast
        act["fc input"] = (F32 if (cuda or sb != F32 or noised) else 0) * n * width
        stats = F32 * n * (int(draft.norm_before_fc) + draft.n_aux * int(draft.fc_norm))  # rsqrt per norm
        # each norm keeps its normed values; each output is kept by the next norm, the last by fc (cast on CUDA)
        act["fc norms"] = stats + (2 * norms - 1) * F32 * n * width + (c if cuda else F32) * n * width
    else:
        act["fc input"] = (c if cuda else (0 if sb == F32 and not noised else F32)) * n * width
        if cuda and noised:  # the float32 noised states beside autocast's cast
            act["fc input"] += F32 * n * width
    act["context mask"] = b * t * t  # bool, built once
    if (cuda if autocast is None else autocast):  # autocast keeps bf16 copies of the matmul weights
        act["autocast weight copies"] = 2 * matmul
    rows = head_rows(b, t, 0)  # the teacher runs at most at rows 1 .. T - 2 (those some kept entry reads)
    act["teacher probabilities"] = F32 * rows * dv + 12 * rows  # probabilities [rows, D], argmax, entropy
    last = head_rows(b, t, kk - 1)
    # the last step's head: its logits (forward) or their gradient (backward), in the compute dtype, + GatheredKL's
    # float32 buffers (forward: the logits' float copy and the gathered teacher rows; backward: q - p and the rows)
    act["last-step transients"] = c * last * dv + 2 * F32 * last * dv
    activations = sum(act.values())
    per_step = sum(steps[-1].values())
    items.append(("activations", activations,
                  f"{kk} TTT steps over {n:,} tokens (last step {_gb(per_step)}; K/V "
                  f"{_gb(act['k/v cache'] + act['k/v copies'])}, log-softmaxes {_gb(act['log-softmax'])}), "
                  f"teacher {_gb(act['teacher probabilities'])}, transients {_gb(act['last-step transients'])}"
                  + (f", bf16 weight copies {_gb(act['autocast weight copies'])}"
                     if "autocast weight copies" in act else "")))
    micro = n * (draft.n_aux * draft.target_hidden_size + h) * sb + n * (8 * 3 + 1)  # states + ids/seq/pos + mask
    resident = 1 if cuda else cfg.grad_accum_steps * (1 + 2 * cfg.loader_workers)
    batch = micro * resident
    items.append(("batches", batch, f"{_gb(micro)} per micro-batch" + (
        "" if cuda else f" x {resident} (the step's {cfg.grad_accum_steps} + 2 steps prefetched per loader "
        f"thread, {cfg.loader_workers} threads)")))
    step_tmp = grads  # AdamW's foreach sqrt(exp_avg_sq) temporary (Muon's per-matrix Newton-Schulz: less)
    items.append(("optimizer step temporary", step_tmp, "during optimizer.step(), after the activations are freed"))
    peak = static + max(activations + batch, step_tmp)
    return MemoryPlan(device=device, parallel=parallel, processes=world, processes_per_host=min(world, cfg.nproc),
                      micro_batch_rows=b,
                      tokens_per_micro_batch=n, ttt_steps=kk, trainable_parameters=trainable,
                      frozen_parameters=frozen, items=[MemoryItem(name=a, bytes=v, detail=dd) for a, v, dd in items],
                      static_bytes=static, activation_bytes=activations, activations=act, batch_bytes=batch,
                      optimizer_step_bytes=step_tmp, peak_bytes=peak)


def free_device_memory(device: torch.device) -> tuple[int, str]:
    """(free bytes, what was measured) where ``device``'s training process allocates: the GPU's free memory, or
    the host's available RAM (psutil)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"{device} free memory (torch.cuda.mem_get_info; {total / 1e9:,.1f} GB total)"
    import psutil

    return int(psutil.virtual_memory().available), "host available RAM (psutil)"


def check_memory(plan: MemoryPlan, free_bytes: int, measured: str, margin_fraction: float,
                 on_insufficient: Literal["fail", "warn"]) -> str | None:
    """None when the plan fits ``free_bytes`` with the margin; else raises ``TrainMemoryError`` (``fail``) or returns
    the warning (``warn``). On CPU the host's RAM holds every process of that host: the need is the plan x its
    processes (nproc; the other nodes' processes live on their own hosts)."""
    need_one = math.ceil(plan.peak_bytes * (1 + margin_fraction))
    need = need_one * (plan.processes_per_host if plan.device == "cpu" else 1)
    if need <= free_bytes:
        return None
    who = (f" x {plan.processes_per_host} processes" if plan.device == "cpu" and plan.processes_per_host > 1
           else "")
    message = (f"training would not fit: the memory plan needs {_gb(plan.peak_bytes)} per process{who} "
               f"({_gb(need)} with the {margin_fraction:.0%} margin, memory_margin_fraction), but {measured} is "
               f"{_gb(free_bytes)}; lower batch_size (or raise grad_accum_steps), max_seq_len or ttt_steps, or set "
               f"on_insufficient_memory: warn to try anyway\n{plan.summary()}")
    if on_insufficient == "fail":
        raise TrainMemoryError(message)
    return message

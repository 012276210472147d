"""The draft trainer's optimizers (TrainConfig.optimizer), one owner for which parameter each one updates.

``adamw``: one AdamW over every trainable parameter. ``muon``: torch.optim.Muon (momentum, then Newton-Schulz
orthogonalization of the update, Keller Jordan's Muon) over the draft's 2D weight matrices (fc, attention, MLP)
and AdamW over the rest: norms, biases and the draft's lm_head (Muon practice excludes embeddings and output heads;
speculators' "muon" optimizer splits the same way). Muon's learning rate follows the run's schedule times
``muon_lr_scale``, with torch's ``match_rms_adamw`` adjustment (an update of RMS 0.2 x lr, as AdamW's typical one),
so ``lr`` means the same on both sides. Each param group carries its ``lr_scale``; ``set_lr`` applies the schedule.

Muon's Newton-Schulz steps are five iterations of three matmuls per matrix per optimizer step. torch.optim.Muon
runs them in bf16: fast on a GPU and on a CPU with native bf16 matmul, ~20x slower than float32 on one without (an
AVX2-only CPU, say); there ``muon_ns_dtype`` "auto" takes Float32Muon: the same algorithm, state and
hyperparameters, with the Newton-Schulz steps in float32 (``muon_ns_dtype`` resolves through the one dtype rule,
resolve_compute_dtype).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from eagle3.support.dtypes import resolve_compute_dtype

if TYPE_CHECKING:
    from eagle3.train.config import TrainConfig

MUON_EXCLUDED = ("lm_head", "embed_tokens")  # 2D, but output head / embedding: AdamW
MUON_LR_ADJUSTMENT = "match_rms_adamw"
MUON_NS_STEPS = 5  # Newton-Schulz iterations (torch's and speculators' default)


def is_muon_parameter(name: str, param: torch.Tensor) -> bool:
    """Muon updates a trainable 2D matrix (both sides > 1) that is not an output head or embedding. The training
    memory plan counts the same set by module (eagle3.train.memory; tests/test_train_memory.py keeps them equal)."""
    return (param.requires_grad and param.ndim == 2 and min(param.shape) > 1
            and not any(hint in name for hint in MUON_EXCLUDED))


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalization of a 2D ``update`` (Keller Jordan's iteration X <- aX +
    (bA + cA^2)X with A = XX^T, on the wide side, after scaling X to norm <= 1), computed in ``dtype``; returned in
    ``dtype``."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_lr(lr: float, shape: torch.Size, adjust: str | None) -> float:
    """The learning rate Muon applies to a matrix of ``shape`` under torch's ``adjust_lr_fn`` rules: "original" (or
    None) sqrt(max(1, rows / cols)) x lr; "match_rms_adamw" 0.2 sqrt(max(rows, cols)) x lr."""
    rows, cols = shape[:2]
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz steps in float32: the same hyperparameters and param groups, the same
    state (one "momentum_buffer" per matrix), so a state_dict of either loads into the other. For CPUs without
    native bf16 matmul, where torch's bf16 steps are the slow part of a training step."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)  # torch's checks and momentum_buffer creation
            lr = float(group["lr"])  # torch's Muon takes a 1-element tensor too
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], torch.float32)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(ortho.to(param.dtype), alpha=-muon_lr(lr, param.shape, group["adjust_lr_fn"]))
        return loss


def muon_ns_dtype(cfg: TrainConfig, device: torch.device | str) -> str:
    """"bfloat16" or "float32": the dtype of Muon's Newton-Schulz steps for ``cfg.muon_ns_dtype`` on ``device``
    ("auto": bfloat16 on CUDA and on a CPU with native bf16 matmul, float32 elsewhere)."""
    return resolve_compute_dtype(cfg.muon_ns_dtype, "bfloat16", device)


def build_optimizers(model: nn.Module, cfg: TrainConfig, device: torch.device | str) -> list[torch.optim.Optimizer]:
    """The optimizers of ``model``'s trainable parameters under ``cfg.optimizer`` (stepped together); ``device``
    decides Muon's Newton-Schulz dtype under ``muon_ns_dtype`` "auto"."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw_kw = {"lr": cfg.lr, "betas": cfg.adam_betas, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([{"params": [p for _, p in named], "lr_scale": 1.0}], **adamw_kw)]
    muon = [p for n, p in named if is_muon_parameter(n, p)]
    rest = [p for n, p in named if not is_muon_parameter(n, p)]
    out: list[torch.optim.Optimizer] = []
    if muon:
        muon_class = Float32Muon if muon_ns_dtype(cfg, device) == "float32" else torch.optim.Muon
        out.append(muon_class([{"params": muon, "lr_scale": cfg.muon_lr_scale}],
                              lr=cfg.lr * cfg.muon_lr_scale, momentum=cfg.muon_momentum,
                              weight_decay=cfg.muon_weight_decay, ns_steps=MUON_NS_STEPS,
                              adjust_lr_fn=MUON_LR_ADJUSTMENT))
    if rest:
        out.append(torch.optim.AdamW([{"params": rest, "lr_scale": 1.0}], **adamw_kw))
    return out


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    """The schedule's learning rate of this step, times each param group's ``lr_scale``."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # a resume state saved before lr_scale: AdamW

"""The draft trainer's optimizers (TrainConfig.optimizer), one owner for which parameter each one updates.

``adamw``: one AdamW over every trainable parameter. ``muon``: torch.optim.Muon (momentum, then Newton-Schulz
orthogonalization of the update, Keller Jordan's Muon) over the draft's 2D weight matrices (fc, attention, MLP)
and AdamW over the rest: norms, biases and the draft's lm_head (Muon practice excludes embeddings and output heads;
speculators' "muon" optimizer splits the same way). Muon's learning rate follows the run's schedule times
``muon_lr_scale``, with torch's ``match_rms_adamw`` adjustment (an update of RMS 0.2 x lr, as AdamW's typical one),
so ``lr`` means the same on both sides. Each param group carries its ``lr_scale``; ``set_lr`` applies the schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

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


def build_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """The optimizers of ``model``'s trainable parameters under ``cfg.optimizer`` (stepped together)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw_kw = {"lr": cfg.lr, "betas": cfg.adam_betas, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([{"params": [p for _, p in named], "lr_scale": 1.0}], **adamw_kw)]
    muon = [p for n, p in named if is_muon_parameter(n, p)]
    rest = [p for n, p in named if not is_muon_parameter(n, p)]
    out: list[torch.optim.Optimizer] = []
    if muon:
        out.append(torch.optim.Muon([{"params": muon, "lr_scale": cfg.muon_lr_scale}],
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

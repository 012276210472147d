"""Run speculators' training CLI (speculators==0.9.0, in its own virtual environment) on a machine without an
accelerator: a launcher that patches at runtime what 0.9 assumes of a GPU, nothing edited on disk.

    .venv-speculators/bin/python bench/speculators_cpu.py --verifier-name-or-path ... --data-path ... [...]

Every argument goes to speculators' own ``TrainConfig.resolve`` (``speculators train --help`` lists them). Patched
(found by trial on a CPU machine): ``torch.accelerator.synchronize`` is a no-op and ``current_device_index`` returns 0; speculators'
device helpers (``speculators.utils.util.get_current_device``, ``speculators.train.checkpointer.get_current_device``,
``speculators.train.trainer.get_local_rank``) return "cpu"; its Trainer's ``device_type`` (the autocast device) is
"cpu". Used by bench/speculators_side_by_side.py.

``--muon-ns-dtype float32`` (taken here, not passed on) runs the Newton-Schulz steps of torch's Muon, which
speculators uses for its weight matrices, in float32 instead of torch's bf16: on a CPU without native bf16 matmul
(AVX2-only) torch's bf16 steps took 25.8 s of a 27.2 s optimizer step, where ours trains with
``train.muon_ns_dtype`` "auto" = float32 there (eagle3.train.optim.Float32Muon). The patch swaps torch's
``torch.optim._muon._zeropower_via_newtonschulz`` for eagle3.train.optim.newton_schulz in float32 (the same
iteration; the only import of this project here); ``bfloat16`` (the default) leaves torch's as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def patch_for_cpu() -> None:
    from speculators.train import checkpointer, trainer
    from speculators.utils import util

    torch.accelerator.synchronize = lambda *args, **kwargs: None
    torch.accelerator.current_device_index = lambda: 0
    util.get_current_device = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    trainer.get_local_rank = lambda: "cpu"  # the trainer moves batches with .to(local_rank)
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"  # read only by the autocast of the train and validation steps

    trainer.Trainer.__init__ = cpu_init


def float32_newton_schulz() -> None:
    """torch's Muon orthogonalizes each update with its Newton-Schulz steps in float32 (see the module docstring)."""
    from torch.optim import _muon

    sys.path.append(str(REPO))  # after speculators' own packages
    from eagle3.train.optim import newton_schulz

    def in_float32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                   eps: float) -> torch.Tensor:
        if grad.ndim != 2:
            raise ValueError("Muon's Newton-Schulz steps take a 2D matrix")
        return newton_schulz(grad, ns_coefficients, ns_steps, eps, torch.float32)

    _muon._zeropower_via_newtonschulz = in_float32


def take_ns_dtype(argv: list[str]) -> tuple[str, list[str]]:
    """(--muon-ns-dtype's value, the other arguments): the flag is this launcher's, not speculators'."""
    rest, dtype, it = [], "bfloat16", iter(argv)
    for arg in it:
        if arg.startswith("--muon-ns-dtype="):
            dtype = arg.partition("=")[2]
        elif arg == "--muon-ns-dtype":
            dtype = next(it, "")
        else:
            rest.append(arg)
    if dtype not in ("bfloat16", "float32"):
        raise SystemExit(f"--muon-ns-dtype: {dtype!r} is not bfloat16 or float32")
    return dtype, rest


def main(argv: list[str]) -> None:
    ns_dtype, argv = take_ns_dtype(argv)
    patch_for_cpu()
    if ns_dtype == "float32":
        float32_newton_schulz()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

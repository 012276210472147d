"""Run speculators' training CLI (speculators==0.9.0, in its own virtual environment) on a machine without an
accelerator: a launcher that patches at runtime what 0.9 assumes of a GPU, nothing edited on disk.

    .venv-speculators/bin/python bench/speculators_cpu.py --verifier-name-or-path ... --data-path ... [...]

Every argument goes to speculators' own ``TrainConfig.resolve`` (``speculators train --help`` lists them). Patched
(found by trial on a CPU machine): ``torch.accelerator.synchronize`` is a no-op and ``current_device_index`` returns 0; speculators'
device helpers (``speculators.utils.util.get_current_device``, ``speculators.train.checkpointer.get_current_device``,
``speculators.train.trainer.get_local_rank``) return "cpu"; its Trainer's ``device_type`` (the autocast device) is
"cpu". Used by bench/speculators_side_by_side.py; imports nothing of this project.
"""

from __future__ import annotations

import sys

import torch


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


def main(argv: list[str]) -> None:
    patch_for_cpu()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

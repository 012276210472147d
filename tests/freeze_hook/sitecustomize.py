"""Test-only fault injection (tests/test_train_multinode.py): freeze a training worker at a chosen optimizer step.

A kill -9 test must kill a training process at a known point whatever the machine's speed (a fast machine finished a
whole epoch between two polls of a loaded test process). The test puts this folder on the PYTHONPATH of one "host"'s
Prefect worker and names a JSON file in EAGLE3_TEST_FREEZE: {"run_dir": ..., "step": K, "record": path}. Every Python
process of that host then imports this module at start-up (Python's sitecustomize hook); it only registers an import
hook, and when ``eagle3.train.trainer`` loads, wraps ``Trainer._optimizer_step``: a worker of the first launch
(TORCHELASTIC_RESTART_COUNT 0) training under ``run_dir`` that is about to make optimizer step K + 1 writes
{"pid", "time", "global_step"} to ``record`` and stops itself with SIGSTOP. Steps 1..K are done on every rank (the
others wait for it in the next step's first collective); the test then kills the stopped process.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import time

TARGET = "eagle3.train.trainer"


def _freeze_if_due(trainer) -> None:
    spec_file = os.environ.get("EAGLE3_TEST_FREEZE")
    if not spec_file or not os.path.isfile(spec_file) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    with open(spec_file) as f:
        spec = json.load(f)
    if trainer.global_step != spec["step"] or not str(trainer.out_dir).startswith(spec["run_dir"]):
        return
    with open(spec["record"], "w") as f:
        json.dump({"pid": os.getpid(), "time": time.time(), "global_step": trainer.global_step}, f)
    os.kill(os.getpid(), signal.SIGSTOP)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            step = module.Trainer._optimizer_step

            def optimizer_step(self, batches):
                _freeze_if_due(self)
                return step(self, batches)

            module.Trainer._optimizer_step = optimizer_step

        spec.loader.exec_module = exec_and_wrap
        return spec


if os.environ.get("EAGLE3_TEST_FREEZE"):
    sys.meta_path.insert(0, _Hook())

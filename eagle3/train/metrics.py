"""The training run's metrics: one JSON line per logged optimizer step and per validation in metrics.jsonl
(appended as they happen; a crash leaves at most a torn last line, skipped when read), and the charts drawn from them
after each epoch (loss.png, accuracy.png, acceptance.png in the training folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


def append_metrics(path: str | Path, rec: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (a torn last line from a crash is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_plots(out_dir: str | Path, history: list[dict[str, Any]], ttt_steps: int) -> None:
    """Loss and top-1 accuracy per TTT step (train and validation), and the validation acceptance lengths."""
    from eagle3.support.plot import line_chart

    out_dir = Path(out_dir)
    train = [r for r in history if r["event"] == "train"]
    val = [r for r in history if r["event"] == "val" and r["counted_per_step"][0] > 0]
    k = range(ttt_steps)
    loss = {f"step {j}": [(r["global_step"], r["loss_per_step"][j]) for r in train] for j in k}
    loss["val (weighted)"] = [(r["global_step"], r["loss"]) for r in val]
    loss["train (weighted)"] = [(r["global_step"], r["loss"]) for r in train]
    acc = {f"step {j}": [(r["global_step"], r["acc_per_step"][j]) for r in train] for j in k}
    for j in k:
        acc[f"val step {j}"] = [(r["global_step"], r["acc_per_step"][j]) for r in val]
    line_chart(out_dir / "loss.png", {n: s for n, s in loss.items() if s}, "Draft training loss (KL)",
               "optimizer step", "KL (nats)")
    line_chart(out_dir / "accuracy.png", {n: s for n, s in acc.items() if s},
               "Draft top-1 accuracy per TTT step", "optimizer step", "accuracy")
    if val:
        line_chart(out_dir / "acceptance.png",
                   {"sim accept": [(r["global_step"], r["sim_accept_len"]) for r in val],
                    "chain accept": [(r["global_step"], r["chain_accept_len"]) for r in val]},
                   "Validation simulated acceptance length", "optimizer step", "tokens per verifier step")

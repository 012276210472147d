"""The trainer's tokens/s at two git revisions of the library, side by side on one real store.

    .venv/bin/python bench/train_rev_speed.py --run-dir R/smollm2-demo --revs REV_A,REV_B [--steps 30] [--preset smollm2]

``--run-dir``: a pipeline run folder holding a regenerated dataset and an extraction (``make demo-real``'s).
Each revision's ``eagle3/`` and ``prefect.yaml`` are unpacked from git into a temporary checkout (its ``models/``
a link to this checkout's); each run is a fresh process whose ``eagle3`` is that revision's, training the preset's
draft from scratch for ``--steps`` optimizer steps (``train.stop_after_steps``) on the same store, in the order
A B B A so that a change in the machine's load lands on both. The figure is the trainer's own tokens/s after its
first logged window (bench/muon_ns_dtype.steady_tokens_per_s), the median of each revision's two runs; also the
trainer's loss at the last step (the same data and seed: equal up to rounding when the change is an exact
rewrite). Prints the machine load (1/5/15 min) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from muon_ns_dtype import print_medians, steady_tokens_per_s
from recipe import latest_dir

REPO = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
from pathlib import Path
import eagle3
assert Path(eagle3.__file__).resolve().is_relative_to(Path.cwd().resolve()), eagle3.__file__
from eagle3.config import load_config
from eagle3.support.verifier import VerifierSpec
from eagle3.train.stage import train_draft
from eagle3.vocab import build_vocab
preset, dataset, store, out, steps = sys.argv[1:6]
config = load_config(preset, {"train.stop_after_steps": int(steps), "train.log_every_steps": 5})
out = Path(out)
vocab = build_vocab(config.vocab, Path(dataset), VerifierSpec.from_path(config.verifier).vocab_size, out / "vocab")
train_draft(config.train_config(), Path(store), vocab, out / "train", verifier=config.verifier)
"""


def unpack(rev: str, into: Path) -> str:
    """The library and presets of ``rev`` under ``into`` (models/ linked to this checkout's); returns the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "eagle3", "prefect.yaml"], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "models").symlink_to(REPO / "models")
    return commit


def last_loss(metrics: Path) -> float:
    recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "train"]
    return float(recs[-1]["loss"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--revs", required=True, help="two git revisions, comma-separated: A,B")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--preset", default="smollm2")
    args = ap.parse_args()
    revs = args.revs.split(",")
    if len(revs) != 2:
        raise SystemExit(f"--revs: two revisions, got {args.revs!r}")
    dataset = (latest_dir(args.run_dir, "prepare-regenerated") / "dataset").resolve()  # the runs run elsewhere
    store = (latest_dir(args.run_dir, "extract-hidden-states") / "store").resolve()
    print(f"load before: {os.getloadavg()}", flush=True)
    rates: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        commits = [unpack(rev, Path(tmp) / f"rev{i}") for i, rev in enumerate(revs)]
        for run, i in enumerate((0, 1, 1, 0)):
            out = Path(tmp) / f"run-{run}"
            subprocess.run([sys.executable, "-c", WORKER, args.preset, str(dataset), str(store), str(out),
                            str(args.steps)], cwd=Path(tmp) / f"rev{i}", check=True,
                           env={**os.environ, "PYTHONPATH": str(Path(tmp) / f"rev{i}")})
            metrics = out / "train" / "metrics.jsonl"
            rates.setdefault(commits[i], []).append(steady_tokens_per_s(metrics))
            losses.setdefault(commits[i], []).append(last_loss(metrics))
            print(f"{commits[i]}: {rates[commits[i]][-1]:,.0f} tok/s, loss {losses[commits[i]][-1]:.5f}", flush=True)
    print(f"load after: {os.getloadavg()}")
    print_medians(rates, commits, {c: f"; loss at step {args.steps}: {losses[c][0]:.5f}" for c in commits})


if __name__ == "__main__":
    main()

"""The training recipe on SmolLM2-135M-Instruct, one change at a time, each measured by real vLLM (issue 17).

    .venv/bin/python bench/recipe.py --runs-dir runs/recipe --run-name smollm2-all \\
        --variant "baseline:" --variant "bs8:train.batch_size=8" --variant "lr4e-3:train.lr=4e-3" \\
        [--prompts 65] [--set KEY=VALUE ...]

Every variant is the smollm2 preset (prefect.yaml) plus the ``--set`` overrides common to all, plus its own
``KEY=VALUE`` overrides (comma-separated, values parsed as JSON when they parse), run as one pipeline flow in the same
runs folder and run name: prepare, regeneration, extraction and the vocabulary are cached after the first variant
(use ``train.max_samples`` to train on the first N samples of one big extraction), so each variant retrains and
revalidates only. vLLM's mean acceptance length on the first ``--prompts`` held-out prompts (the eval split, never
trained on; 3 draft tokens, 64 new tokens, temperature 0) is the figure; printed beside it: the trainer's own
simulated acceptance on its validation split, optimizer steps, tokens trained, training wall time and the machine
load (1/5/15 min) at the end of each variant. Results are appended to ``<runs-dir>/recipe-results.jsonl`` as they
come, so a long queue can be read while it runs. No decoding speed here (speed_repeats 0): bench/vllm_cpu_speed.py.

``--from-run RUN_DIR`` trains on a store made earlier (that folder's newest prepare-regenerated-* dataset and
extract-hidden-states-* store, for example a 2,056-conversation extraction made by another checkout, whose stage keys
need not match this one's): each variant then builds the vocabulary, trains and validates through the same library
functions the flow's stages call, into ``<runs-dir>/<variant>/``, with the preset's settings plus the overrides;
the extraction settings of the store (aux layers, dtype) are the store's own. ``--from-stages PREPARE_DIR
STORE_DIR`` names the two stage folders instead (a prepare-regenerated-* folder and an extract-hidden-states-*
folder), where a run folder holds several of each and the newest is not the pair wanted; that the store was
extracted from that dataset is the caller's word (the vocabulary is built on the dataset, training reads the store).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from tasks.prefect_env import apply_prefect_env_defaults  # before Prefect is imported

apply_prefect_env_defaults()

from eagle3.config import PipelineConfig, load_config, parse_set
from eagle3.support.paths import resolve_path
from eagle3.support.verifier import VerifierSpec
from eagle3.train.stage import DraftCheckpoint, train_draft
from eagle3.validate.stage import validate_draft
from eagle3.vocab import build_vocab
from flows.eagle3_pipeline import eagle3_pipeline


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_variant(text: str) -> tuple[str, dict]:
    """"name:key=value,key=value" -> (name, overrides); a value is JSON when it parses, else a string."""
    name, _, rest = text.partition(":")
    return name, parse_set([kv for kv in rest.split(",") if kv.strip()])


def latest_dir(run_dir: Path, stage: str) -> Path:
    """The stage folder of ``run_dir`` written last (the variant just run)."""
    found = list(Path(run_dir).glob(f"{stage}-*"))
    if not found:
        raise SystemExit(f"{run_dir}: no {stage}-* folder there (run the pipeline's {stage} stage into it first)")
    return max(found, key=lambda p: p.stat().st_mtime)


def stage_pair(store_run: Path | None, stages: list[Path] | None) -> tuple[Path, Path]:
    """(dataset, store) folders: ``stages`` = [prepare stage folder, extraction stage folder] as named, else
    ``store_run``'s newest regenerated dataset and store."""
    if stages:
        dataset, store = stages[0].resolve() / "dataset", stages[1].resolve() / "store"
        for path, flag in ((dataset, "PREPARE_DIR"), (store, "STORE_DIR")):
            if not path.is_dir():
                raise SystemExit(f"--from-stages {flag}: {path} is not a folder (name the stage folder that holds it)")
        return dataset, store
    return (latest_dir(store_run, "prepare-regenerated") / "dataset",
            latest_dir(store_run, "extract-hidden-states") / "store")


def run_from_store(config: PipelineConfig, dataset: Path, store: Path, out: Path) -> tuple[DraftCheckpoint, dict]:
    """vocab -> train -> validate on a prepared ``dataset`` and its ``store``, into ``out``: the library calls of the
    flow's vocab, train and validate stages, without the flow (no stage keys to match)."""
    vocab = build_vocab(config.vocab, dataset, VerifierSpec.from_path(config.verifier).vocab_size, out / "vocab")
    ckpt = train_draft(config.train_config(), store, vocab, out / "train", verifier=config.verifier)
    report = validate_draft(config.validate_config, ckpt, out / "validate", verifier=config.verifier,
                            prompts_path=resolve_path(config.validate_config.prompts_path), chat=config.chat_settings())
    return ckpt, report.report()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", required=True)
    ap.add_argument("--run-name", default="recipe")
    ap.add_argument("--variant", action="append", required=True, help="NAME:KEY=VALUE,KEY=VALUE (repeatable)")
    ap.add_argument("--prompts", type=int, default=65, help="held-out validation prompts")
    ap.add_argument("--set", action="append", default=[], help="overrides common to every variant")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--from-run", type=Path, help="train on this run folder's store instead of running the flow")
    source.add_argument("--from-stages", type=Path, nargs=2, metavar=("PREPARE_DIR", "STORE_DIR"),
                        help="train on these two stage folders (a prepare-regenerated-* and its "
                        "extract-hidden-states-*) instead of running the flow")
    args = ap.parse_args()
    common = {"runs_dir": args.runs_dir, "run_name": args.run_name, "validate.num_prompts": args.prompts,
              "validate.compare_untrained": False, "validate.speed_repeats": 0,
              "validate.min_mean_acceptance_length": None, **parse_set(args.set)}
    log_path = Path(args.runs_dir) / "recipe-results.jsonl"
    print(f"machine load (1/5/15 min) at start: {_load()}", flush=True)
    rows = {}
    for text in args.variant:
        name, overrides = parse_variant(text)
        t0 = time.perf_counter()
        if args.from_run or args.from_stages:
            ckpt, report = run_from_store(load_config("smollm2", {**common, **overrides}),
                                          *stage_pair(args.from_run, args.from_stages), Path(args.runs_dir) / name)
            rows[name] = _row(name, overrides, ckpt, report, time.perf_counter() - t0, common, args, log_path)
            continue
        state = eagle3_pipeline(load_config("smollm2", {**common, **overrides}), return_state=True)
        wall = time.perf_counter() - t0
        if state.is_completed():
            summary = state.result()
            ckpt = DraftCheckpoint.load(Path(summary["checkpoint"]).parent.parent)
            report = json.loads(Path(summary["report"]).with_name("report.json").read_text())
        else:  # a failed verdict still wrote its report: the stage folders written last are this variant's
            print(f"{name}: the flow ended {state.type.value}: {state.message}", flush=True)
            run_dir = Path(load_config("smollm2", {**common, **overrides}).run_dir)
            ckpt = DraftCheckpoint.load(latest_dir(run_dir, "train-draft"))
            report = json.loads((latest_dir(run_dir, "validate-draft") / "report.json").read_text())
        rows[name] = _row(name, overrides, ckpt, report, wall, common, args, log_path)
    print(f"\n{'variant':32}{'vLLM AL':>9}{'sim':>8}{'steps':>7}{'train s':>9}  load (end)")
    for name, r in rows.items():
        print(f"{name:32}{r['vllm']:>9.3f}{r['sim']:>8.3f}{r['steps']:>7}{r['train_s']:>9.0f}  {r['load_end']}")


def _row(name, overrides, ckpt, report, wall, common, args, log_path) -> dict:
    """One variant's figures: appended to ``log_path`` and printed."""
    acc = report["vllm"]["acceptance"]
    row = {"variant": name, "overrides": overrides, "vllm": acc["mean_acceptance_length"],
           "per_position": acc["per_position_acceptance"], "lossless": report["vllm"]["lossless"],
           "sim": (ckpt.final_val or {}).get("sim_accept_len"), "best_epoch": ckpt.best_epoch,
           "steps": ckpt.global_step, "tokens": ckpt.tokens_seen, "draft_vocab_size": ckpt.draft_vocab_size,
           "train_s": ckpt.wall_s, "flow_s": wall,
           "load_end": _load(), "common": common, "prompts": args.prompts,
           "from_run": str(args.from_run.resolve()) if args.from_run else None,
           "from_stages": [str(p.resolve()) for p in args.from_stages] if args.from_stages else None}
    with log_path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{name}: vLLM mean acceptance length {row['vllm']:.3f} (per position "
          f"{[round(x, 3) for x in row['per_position']]}), trainer sim {row['sim']:.3f}, {row['steps']} steps, "
          f"{row['tokens']:,} tokens, draft vocab {row['draft_vocab_size']:,}, train {row['train_s']:.0f} s, "
          f"flow {wall:.0f} s, load {row['load_end']}",
          flush=True)
    return row


if __name__ == "__main__":
    main()

"""Our draft training against speculators 0.9's, on the same data, side by side in one run (issue 17).

    .venv/bin/python bench/speculators_side_by_side.py --run-dir runs/recipe/smollm2-all [--samples 600] [--epochs 3]
        [--prompts 65] [--out DIR] [--equal-wall-clock] [--speculators-python PYTHON] [--set KEY=VALUE ...]

Same inputs for both: the hidden-state store and the draft vocabulary (d2t / t2d) of a finished pipeline run (its
extract-hidden-states and build-vocab stages: SmolLM2's own regenerated answers, aux layers [2, 15, 27] in vLLM's
convention, the final pre-norm state), its first ``--samples`` samples, the same epochs. The store is written out in
speculators' offline format (a ``datasets`` folder with input_ids / loss_mask / seq_len and
``hidden_states/hs_<i>.safetensors`` holding [T, n_aux + 1, H] states, the last one the final state, plus token_ids).
Everything else is each tool's own recipe: ours the smollm2 preset's train section (plus any ``--set`` overrides,
e.g. ``--set train.optimizer=muon``), speculators its defaults for
eagle3 (norm_before_fc, norm_output, norm_before_residual, Muon + AdamW at lr 1e-3, linear schedule, equal TTT step
weights); both compute in our preset's dtypes on this CPU (train.cpu_dtype and train.muon_ns_dtype resolved: float32
for both on a CPU without native bf16, where speculators' default bf16 autocast and torch's bf16 Newton-Schulz steps
crawl; given to speculators as --hidden-states-dtype and bench/speculators_cpu.py's --muon-ns-dtype); both unroll 3
TTT steps and see the same tokens per optimizer step (the preset's
train.batch_size packed rows x max_seq_len tokens, given to speculators as --total-seq-len; speculators' own default
is 8192). Both train on the CPU (ours with train.device cpu, even where a GPU is present; speculators through
bench/speculators_cpu.py: runtime patches, its own
venv, with the two settings a CPU needs: --draft-attn-impl sdpa (its default FlexAttention has no backward on a CPU)
and --loss-implementation eager (its fused losses need Triton)).

Measured for each: training wall time, trained tokens/s (real tokens x epochs / wall), peak resident memory of the
training process (/usr/bin/time's maximum RSS), and vLLM's mean acceptance length on the held-out prompts (the eval
split's first ``--prompts`` user turns, never trained on; 3 draft tokens, 64 new tokens, temperature 0); then the
ratios ours / speculators. ``--equal-wall-clock`` adds a second round where the faster tool gets as many epochs as
fit in the slower tool's first-round wall time (to the nearest epoch, at least the same: rounding down left 3 against
3 when one tool took 1.3x as long), so both train for about the same minutes; a tool whose epochs are the first
round's keeps its first-round draft (same settings, same run). One training or one vLLM engine at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# speculators' own environment (its pins clash with the pipeline's): EAGLE3_SPECULATORS_PYTHON, else .venv-speculators
# in the checkout, made with: python3 -m venv .venv-speculators && .venv-speculators/bin/pip install
# speculators==0.9.0 torch==2.13.0 && .venv-speculators/bin/pip uninstall -y torchvision torchaudio torchcodec
SPECULATORS_PYTHON = os.environ.get("EAGLE3_SPECULATORS_PYTHON", str(REPO / ".venv-speculators" / "bin" / "python"))
PROMPTS = REPO / "data" / "stdlib-chat" / "eval.openai.jsonl"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def stage_folder(run_dir: Path, stage: str, inner: str) -> Path:
    found = sorted(run_dir.glob(f"{stage}-*/{inner}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"{run_dir} has no {stage}-*/{inner}: run the pipeline there first")
    return found[-1]


def to_speculators_format(store_dir: Path, mapping: Path, samples: int | None, out: Path) -> int:
    """Our store -> speculators' offline data folder (+ d2t / t2d .npy). Returns the number of samples."""
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from eagle3.store import HiddenStateStore
    from eagle3.vocab import load_mapping

    store = HiddenStateStore(store_dir)
    indices = sorted(store.indices())[:samples]
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    h, n_aux = store.hidden_size, len(store.aux_layer_ids)
    for j, i in enumerate(indices):
        s = store.load(i)
        t = s["input_ids"].shape[0]
        states = torch.cat([s["aux_hidden_states"].reshape(t, n_aux, h), s["final_hidden_state"].reshape(t, 1, h)],
                           dim=1).to(torch.bfloat16).contiguous()  # [T, n_aux + 1, H], the final state last
        save_file({"hidden_states": states, "token_ids": s["input_ids"].clone()},
                  str(out / "hidden_states" / f"hs_{j}.safetensors"))
        rows["input_ids"].append(s["input_ids"].tolist())
        rows["loss_mask"].append(s["loss_mask"].long().tolist())
        rows["seq_len"].append(t)
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))
    d2t, t2d = load_mapping(mapping)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return len(indices)


def timed(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` under /usr/bin/time -v (its own output to ``log``): wall seconds and peak RSS in MiB."""
    t = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            check=False).returncode
    wall = time.monotonic() - t
    text = log.read_text(errors="replace")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if rc:
        raise SystemExit(f"{cmd[:3]} failed (exit {rc}); see {log}:\n" + "\n".join(text.splitlines()[-30:]))
    return {"wall_s": wall, "peak_rss_mib": int(rss.group(1)) / 1024 if rss else None}


def ours_side(ns: argparse.Namespace) -> None:
    """Our trainer in this process (run under /usr/bin/time by the orchestrator)."""
    import logging

    from eagle3.config import load_config, parse_set
    from eagle3.train.stage import train_draft
    from tools.gguf_convert import SMOLLM2_DIR

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = load_config("smollm2", {**parse_set(ns.set), "train.epochs": ns.epochs, "train.max_samples": ns.samples,
                                  "train.keep_last_n": 1, "train.device": "cpu"}).train_config()  # as speculators
    ckpt = train_draft(cfg, ns.store, ns.mapping, ns.ours_out, verifier=SMOLLM2_DIR, resume=False)
    Path(ns.ours_out, "result.json").write_text(json.dumps({
        "checkpoint_dir": ckpt.checkpoint_dir, "tokens_seen": ckpt.tokens_seen, "train_wall_s": ckpt.wall_s,
        "global_step": ckpt.global_step, "best_epoch": ckpt.best_epoch, "final_val": ckpt.final_val}))


def train_ours(store: Path, mapping: Path, samples: int, epochs: int, out: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--ours-side", "--store", str(store), "--mapping", str(mapping),
           "--samples", str(samples), "--epochs", str(epochs), "--ours-out", str(out),
           *(f"--set={kv}" for kv in overrides)]
    out.mkdir(parents=True, exist_ok=True)
    r = timed(cmd, out / "train.log", env={**os.environ, "PYTHONPATH": str(REPO)})
    res = json.loads((out / "result.json").read_text())
    return {**r, "draft": res["checkpoint_dir"], "tokens": res["tokens_seen"], "train_wall_s": res["train_wall_s"],
            "steps": res["global_step"], "epochs": epochs, "note": f"best epoch {res['best_epoch']} of {epochs}"}


def ours_dtypes(overrides: list[str]) -> tuple[str, str]:
    """Our smollm2 preset's training dtypes on this CPU (after ``--set``): (compute dtype: train.cpu_dtype resolved,
    Muon's Newton-Schulz dtype: train.muon_ns_dtype resolved). Speculators gets the same two (its
    --hidden-states-dtype, its autocast dtype; bench/speculators_cpu.py's --muon-ns-dtype), so that the side by side
    compares recipes, not one tool's bf16 against the other's float32 on a CPU that may lack native bf16."""
    from eagle3.config import load_config, parse_set
    from eagle3.support.dtypes import resolve_compute_dtype
    from eagle3.train.optim import muon_ns_dtype

    cfg = load_config("smollm2", parse_set(overrides)).train_config()
    return resolve_compute_dtype(cfg.cpu_dtype, "bfloat16", "cpu"), muon_ns_dtype(cfg, "cpu")


def tokens_per_step(overrides: list[str]) -> int:
    """Our smollm2 preset's tokens per optimizer step (packed rows x row length, after ``--set``): speculators gets
    the same."""
    from eagle3.config import load_config, parse_set

    cfg = load_config("smollm2", parse_set(overrides)).train_config()
    return cfg.batch_size * cfg.max_seq_len


def train_speculators(python: str, data: Path, samples: int, epochs: int, out: Path, step_tokens: int,
                      dtypes: tuple[str, str]) -> dict:
    import numpy as np

    from tools.gguf_convert import SMOLLM2_DIR

    cmd = [python, str(REPO / "bench" / "speculators_cpu.py"),
           "--verifier-name-or-path", str(SMOLLM2_DIR), "--data-path", str(data), "--speculator-type", "eagle3",
           "--target-layer-ids", "2", "15", "27", "--d2t-path", str(data / "d2t.npy"), "--t2d-path",
           str(data / "t2d.npy"), "--draft-vocab-size", str(len(np.load(data / "d2t.npy"))),
           "--epochs", str(epochs),
           "--total-seq-len", str(step_tokens),
           "--train-data-ratio", "0.95", "--num-workers", "1", "--prefetch-factor", "2", "--ttt-steps", "3",
           "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"), "--no-resume-from-checkpoint",
           # on a CPU: FlexAttention has no backward there, the fused losses need Triton (0.9 refuses both)
           "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
           # ours' dtypes on this CPU (ours_dtypes); the second is the launcher's flag, not speculators'
           "--hidden-states-dtype", dtypes[0], "--muon-ns-dtype", dtypes[1]]
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = timed(cmd, out / "train.log", env=env)
    ckpts = sorted((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not ckpts:
        raise SystemExit(f"speculators wrote no epoch checkpoint in {out / 'checkpoints'}")
    return {**r, "draft": str(ckpts[-1]), "epochs": epochs, "note": f"last epoch ({ckpts[-1].name})"}


def acceptance(draft: str, prompts: int, work: Path) -> dict:
    """vLLM's mean acceptance length of ``draft`` on the held-out prompts (the validation's own vLLM check)."""
    from eagle3.chat.encoder import ChatSettings
    from eagle3.validate.config import ValidateConfig
    from eagle3.validate.stage import run_vllm_check
    from tools.gguf_convert import SMOLLM2_DIR

    cfg = ValidateConfig(num_prompts=prompts, max_new_tokens=64, speed_repeats=0, dtype="float32",
                         max_model_len=2048)
    prompt_ids = ChatSettings(tokenizer_path=str(SMOLLM2_DIR)).held_out_prompt_ids(PROMPTS, prompts)
    result = run_vllm_check(cfg, SMOLLM2_DIR, [draft], prompt_ids, work)
    d = result["drafts"][0]
    return {"mean_acceptance_length": d["acceptance"]["mean_acceptance_length"],
            "per_position": d["acceptance"]["per_position_acceptance"], "lossless": d["lossless"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a pipeline run folder with finished extract-hidden-states and build-vocab")
    ap.add_argument("--samples", type=int, default=600, help="the store's first N samples, for both")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=65, help="held-out prompts for vLLM's acceptance length")
    ap.add_argument("--out", help="work folder (default: a temporary one, kept)")
    ap.add_argument("--equal-wall-clock", action="store_true", help="a second round at about equal training minutes")
    ap.add_argument("--speculators-python", default=SPECULATORS_PYTHON)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE override of our preset (repeatable); "
                    "--epochs and --samples set train.epochs and train.max_samples over it")
    ap.add_argument("--ours-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--mapping", help=argparse.SUPPRESS)
    ap.add_argument("--ours-out", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.ours_side:
        return ours_side(ns)
    run_dir = Path(ns.run_dir).resolve()
    store = stage_folder(run_dir, "extract-hidden-states", "store")
    mapping = stage_folder(run_dir, "build-vocab", "mapping.safetensors")
    out = Path(ns.out or tempfile.mkdtemp(prefix="speculators-side-by-side-")).resolve()
    compute, ns_dtype = ours_dtypes(ns.set)
    print(f"work folder {out}; store {store}; {tokens_per_step(ns.set)} tokens per optimizer step for both; compute "
          f"dtype {compute}, Muon's Newton-Schulz steps in {ns_dtype} for both; ours: the smollm2 preset"
          f"{' with ' + ', '.join(ns.set) if ns.set else ''}; load at start {_load()}", flush=True)
    data = out / "speculators-data"
    if not (data / "dataset_info.json").is_file():
        n = to_speculators_format(store, mapping, ns.samples, data)
        print(f"{n} samples written in speculators' format to {data}", flush=True)
    token_count = sum(int(x) for x in __import__("datasets").load_from_disk(str(data))["seq_len"])

    rounds = {}

    def one_round(name: str, epochs: dict[str, int]) -> None:
        rows = {}
        for tool in ("ours", "speculators"):
            earlier = next((r[tool] for r in rounds.values() if r[tool]["epochs"] == epochs[tool]), None)
            if earlier is not None:  # the same training again would give the same draft: reuse it, say so
                rows[tool] = {**earlier, "note": earlier["note"] + " (the same run as the first round)"}
                print(f"[{name}] {tool}: {epochs[tool]} epochs, as in the first round: reused", flush=True)
                continue
            print(f"[{name}] training {tool} for {epochs[tool]} epochs (load {_load()})", flush=True)
            folder = out / name / tool
            if tool == "ours":
                r = train_ours(store, mapping, ns.samples, epochs[tool], folder, ns.set)
            else:
                r = train_speculators(ns.speculators_python, data, ns.samples, epochs[tool], folder,
                                      tokens_per_step(ns.set), ours_dtypes(ns.set))
                r["tokens"] = round(token_count * 0.95) * epochs[tool]  # its train split, every epoch
            r["tokens_per_s"] = r["tokens"] / r["wall_s"]
            print(f"[{name}] {tool}: {r['wall_s']:.0f} s, {r['tokens_per_s']:.0f} tok/s, peak RSS "
                  f"{r['peak_rss_mib']:.0f} MiB (load {_load()})", flush=True)
            r.update(acceptance(r["draft"], ns.prompts, folder / "vllm"))
            print(f"[{name}] {tool}: vLLM mean acceptance length {r['mean_acceptance_length']:.3f} "
                  f"(load {_load()})", flush=True)
            rows[tool] = r
        rounds[name] = rows
        (out / "results.json").write_text(json.dumps({"compute_dtype": compute, "muon_ns_dtype": ns_dtype,
                                                      "rounds": rounds}, indent=1))

    one_round("equal-epochs", {"ours": ns.epochs, "speculators": ns.epochs})
    if ns.equal_wall_clock:
        r = rounds["equal-epochs"]
        slow, fast = sorted(r, key=lambda t: r[t]["wall_s"], reverse=True)  # two tools even when the walls tie
        more = max(ns.epochs, round(ns.epochs * r[slow]["wall_s"] / r[fast]["wall_s"]))
        one_round("equal-wall-clock", {slow: ns.epochs, fast: more})

    print(f"\n{ns.samples} samples ({token_count:,} tokens), held-out prompts {ns.prompts}; load at the end {_load()}")
    for name, rows in rounds.items():
        print(f"\n{name}:")
        print(f"{'':28}{'ours':>14}{'speculators':>14}{'ours/spec':>12}")
        for label, key, fmt in (("epochs", "epochs", "{:.0f}"), ("training wall (s)", "wall_s", "{:.0f}"),
                                ("trained tokens/s", "tokens_per_s", "{:.0f}"),
                                ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
                                ("vLLM mean acceptance length", "mean_acceptance_length", "{:.3f}")):
            a, b = rows["ours"][key], rows["speculators"][key]
            print(f"{label:28}{fmt.format(a):>14}{fmt.format(b):>14}{a / b:>12.3f}")
        for tool in rows:
            print(f"  {tool}: {rows[tool]['note']}; per position {[round(x, 3) for x in rows[tool]['per_position']]}"
                  f"; lossless {rows[tool]['lossless']}")


if __name__ == "__main__":
    main()

"""Demo pipeline timings on this machine: wall time per stage of a cold run of a preset (tiny: `make demo`;
smollm2: `make demo-real`), then a fully cached rerun, side by side in one process (one Prefect ephemeral API).
Prints per-stage wall time (target: all under 15 minutes on 2 cores), the cached rerun's time beyond interpreter
and Prefect start-up (target: under 10 s), the vLLM acceptance and the decoding speedup.

    .venv/bin/python bench/demo_pipeline.py [--preset smollm2] [--set train.epochs=1 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
from tasks.prefect_env import apply_prefect_env_defaults  # before Prefect is imported

apply_prefect_env_defaults()

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from eagle3.config import load_config, parse_set
from eagle3.support.subproc import start_reaper
from eagle3.validate.report import speed_spread, speed_summary_text
from flows.eagle3_pipeline import eagle3_pipeline


def stage_times(flow_run_id) -> dict[str, tuple[str, float]]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    out = {}
    for tr in sorted(runs, key=lambda r: r.start_time or r.expected_start_time):
        secs = (tr.end_time - tr.start_time).total_seconds() if tr.start_time and tr.end_time else 0.0
        out[tr.name.rsplit("-", 1)[0]] = (tr.state.name, secs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    imported = time.perf_counter() - T0
    runs_dir = tempfile.mkdtemp(prefix="eagle3-bench-")
    config = load_config(args.preset, {"runs_dir": runs_dir, **parse_set(args.set)})
    print(f"preset {args.preset}; machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    start_reaper()  # a kill -9 of this process must not leave Prefect's temporary API server running
    results = []
    for label in ("cold", "cached"):
        t = time.perf_counter()
        state = eagle3_pipeline(config, return_state=True)
        wall = time.perf_counter() - t
        results.append((label, wall, stage_times(state.state_details.flow_run_id), state.result()))
    print(f"\ninterpreter + imports: {imported:.1f} s (runs in {runs_dir})")
    print(f"{'stage':<24}{'cold (s)':>10}{'cached (s)':>12}  cached state")
    cold, cached = results[0][2], results[1][2]
    for stage in cold:
        print(f"{stage:<24}{cold[stage][1]:>10.1f}{cached.get(stage, ('-', 0))[1]:>12.2f}  {cached.get(stage, ('-',))[0]}")
    print(f"{'flow wall':<24}{results[0][1]:>10.1f}{results[1][1]:>12.2f}")
    print(f"cold run total: {results[0][1] / 60:.1f} min (target < 15 min on 2 cores); cached rerun: "
          f"{results[1][1]:.2f} s beyond interpreter start-up (target < 10 s)")
    r = results[0][3]
    untrained = r["untrained_mean_acceptance_length"]
    print(f"verdict {r['verdict']}: mean acceptance length {r['mean_acceptance_length']:.3f}" + (
        f" (untrained draft {untrained:.3f}, ratio {r['mean_acceptance_length'] / untrained:.2f}x)" if untrained else ""))
    report = json.loads(Path(r["report"]).with_name("report.json").read_text())
    speed = (report.get("vllm") or {}).get("speed") or {}
    if speed.get("speedup") is not None:
        print(f"decoding speedup {speed_summary_text(speed)} (engine sessions {speed.get('schedule')})")
        for lv in speed.get("levels") or [speed]:
            print(f"  {lv['concurrency']} in flight: tok/s with the draft {lv['draft_output_tokens_per_second']}, "
                  f"without {lv['baseline_output_tokens_per_second']}, load {lv.get('load_1min')}")
            if (spread := speed_spread(lv)) is not None:
                print(f"  not reliable: the repeats ranged {spread} (the machine's load changed during the measurement)")
    print(f"machine load at the end (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

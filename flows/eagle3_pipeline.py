"""The EAGLE-3 pipeline as Prefect flows. Flows only wire tasks; tasks only call `eagle3`.

    prepare -> capacity plan -> extract -> vocab -> train -> validate

Three flows, deployed by prefect.yaml: the whole pipeline, extraction alone (a shard range per GPU host), and
train + validate over an existing store. Run locally with Prefect's ephemeral API (no server to start):

    python -m flows.eagle3_pipeline --preset tiny [--set train.epochs=2 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

# the library logs through the "eagle3" logger (progress lines, OOM halvings, skipped rows): route it into Prefect's
# handlers so it reaches the console and the run's logs in the UI. Deployments set it in prefect.yaml's job env.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "eagle3")

from prefect import flow

logging.getLogger("eagle3").setLevel(logging.INFO)  # progress lines are INFO; Prefect's root logger is at WARNING

from eagle3.config import PipelineConfig, load_config, parse_set, preset_names
from eagle3.support.paths import resolve_path
from tasks.capacity import plan_capacity_task
from tasks.common import describe_file, describe_inputs, result_storage_block, run_stage
from tasks.extract import extract_hidden_states_task
from tasks.prepare import prepare_data
from tasks.train import train_draft_task
from tasks.validate import validate_draft_task
from tasks.vocab import build_vocab_task


class DraftValidationFailed(RuntimeError):
    """The trained draft did not pass validation; the message names the checkpoint, the reasons and the report."""


# the flow-run form's defaults: the tiny preset (checkout-relative paths, so the default is portable)
DEFAULT_CONFIG = load_config("tiny")


def _stages(config: PipelineConfig):
    """The stage tasks with this run's result storage (cache records + manifests) attached."""
    storage = result_storage_block(config.result_storage_path)
    return {t.name: t.with_options(result_storage=storage) for t in (
        prepare_data, plan_capacity_task, extract_hidden_states_task, build_vocab_task, train_draft_task,
        validate_draft_task)}


def _front(config: PipelineConfig, s: dict) -> tuple[dict, dict, dict]:
    inputs = describe_inputs(config.verifier, config.sources)
    data = run_stage(s["prepare-data"], cfg=config.prepare_config(), inputs=inputs, run_dir=config.run_dir)
    plan = run_stage(s["plan-capacity"], cfg=config.capacity_config(), extract=config.extract_config(), inputs=inputs,
                     data=data, run_dir=config.run_dir)
    return inputs, data, plan


@flow(name="eagle3-pipeline", flow_run_name="{config.run_name}")
def eagle3_pipeline(config: PipelineConfig = DEFAULT_CONFIG) -> dict:
    """Chat data + verifier -> trained EAGLE-3 draft, validated in vLLM. Every stage is cached by content."""
    s = _stages(config)
    inputs, data, plan = _front(config, s)
    store = run_stage(s["extract-hidden-states"], cfg=config.extract_config(), host=config.host, inputs=inputs,
                      data=data, plan=plan, run_dir=config.run_dir)
    vocab = run_stage(s["build-vocab"], cfg=config.vocab, inputs=inputs, data=data, run_dir=config.run_dir)
    ckpt = run_stage(s["train-draft"], cfg=config.train_config(), host=config.host, inputs=inputs, store=store,
                     vocab=vocab, run_dir=config.run_dir)
    prompts = describe_file(resolve_path(config.validate_config.prompts_path))
    report = run_stage(s["validate-draft"], cfg=config.validate_config, inputs=inputs, checkpoint=ckpt,
                       prompts=prompts, run_dir=config.run_dir)
    summary = {"run_dir": config.run_dir, "checkpoint": ckpt["best_dir"], "report": report["paths"].get("report_md"),
               "verdict": report["verdict"], "mean_acceptance_length": report.get("mean_acceptance_length"),
               "untrained_mean_acceptance_length": report.get("untrained_mean_acceptance_length")}
    if report["verdict"] != "pass":  # the run ends Failed (alerts fire), after every artifact and report exists
        raise DraftValidationFailed(f"the draft {ckpt['best_dir']} failed validation: {'; '.join(report['reasons'])} "
                                    f"(report: {summary['report']})")
    return summary


@flow(name="eagle3-extract", flow_run_name="{config.run_name}-extract-{shard_start}")
def eagle3_extract(config: PipelineConfig = DEFAULT_CONFIG, shard_start: int = 0, shard_end: int | None = None) -> dict:
    """Prepare + plan + extract only, for the dataset's samples [shard_start, shard_end) (sample indices; None = to
    the end). Several GPU hosts each take a shard through their own work queue; all shards fill one store."""
    s = _stages(config)
    inputs, data, plan = _front(config, s)
    extract = config.extract_config().model_copy(update={"shard_start": shard_start, "shard_end": shard_end})
    return run_stage(s["extract-hidden-states"], cfg=extract, host=config.host, inputs=inputs, data=data, plan=plan,
                     run_dir=config.run_dir)


@flow(name="eagle3-train-validate", flow_run_name="{config.run_name}-train")
def eagle3_train_validate(config: PipelineConfig = DEFAULT_CONFIG) -> dict:
    """Vocab + train + validate over the store that extraction (shards) filled. The same stages as the whole
    pipeline: prepare and plan are cache hits, and the extract stage only verifies the finished store (and fills any
    gap a failed shard left), so training never starts on a partial store."""
    return eagle3_pipeline.fn(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=preset_names(), help="definitions.presets in prefect.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a setting, e.g. --set train.epochs=2 (value parsed as YAML); repeatable")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.preset, parse_set(args.set))
    try:
        result = eagle3_pipeline(config)
    except DraftValidationFailed as e:
        print(f"\nFAILED: {e}")
        return 1
    print("\n" + json.dumps(result, indent=2))
    print(f"\nDraft checkpoint (vLLM-ready): {result['checkpoint']}\nValidation report: {result['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

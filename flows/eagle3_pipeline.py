"""The EAGLE-3 pipeline as Prefect flows. Flows only wire tasks; tasks only call `eagle3`.

    prepare -> capacity plan [-> regenerate -> prepare the regenerated conversations] -> extract -> vocab -> train
    -> validate

Flows deployed by prefect.yaml: the whole pipeline, extraction alone (a shard range per GPU host), train + validate
over an existing store, and one node of a multi-node training (started by the train stage when train.nodes > 1). Run locally with Prefect's ephemeral API (no server to start):

    python -m flows.eagle3_pipeline --preset tiny [--set train.epochs=2 ...]

Every flow takes ``config`` (the whole PipelineConfig; a deployment's default is its preset) and ``overrides``
(dotted keys merged onto it and validated, e.g. ``{"train.epochs": 1}``: `prefect deployment run ... -p
overrides='{"train.epochs": 1}'`).
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

from tasks.prefect_env import apply_prefect_env_defaults

# before Prefect is imported (it reads them then): the "eagle3" logger into the run's logs, no telemetry, a startup
# timeout for the temporary server that holds on a loaded machine, flow-run heartbeats (tasks/prefect_env.py)
apply_prefect_env_defaults()

from prefect import flow
from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

logging.getLogger("eagle3").setLevel(logging.INFO)  # progress lines are INFO; Prefect's root logger is at WARNING

from tasks.logs import tag_run_logs

tag_run_logs()  # every line the run sends to the UI starts with the stage (task) or flow that wrote it

from eagle3.config import (
    ConfigError,
    HostConfig,
    PipelineConfig,
    apply_overrides,
    load_config,
    parse_set,
    preset_names,
    validate_config,
)
from eagle3.draft.checkpoint import check_weights
from eagle3.extract.stage import HiddenStates
from eagle3.support.io import sha256_json
from eagle3.support.paths import resolve_path
from eagle3.support.subproc import start_reaper
from eagle3.train.config import TrainConfig
from eagle3.vocab import VocabMapping
from tasks import artifacts
from tasks.capacity import plan_capacity_task
from tasks.common import (
    describe_prompts_task,
    describe_regenerated_task,
    describe_sources_task,
    describe_tokenizer_task,
    describe_verifier_task,
    result_storage_block,
    run_stage,
)
from tasks.extract import extract_hidden_states_task
from tasks.prepare import prepare_data_task
from tasks.regenerate import regenerate_task
from tasks.train import train_draft_task, train_node_task
from tasks.validate import validate_draft_task
from tasks.vocab import build_vocab_task


class DraftValidationFailed(RuntimeError):
    """The trained draft did not pass validation; the message names the checkpoint, the reasons and the report."""


class CheckpointModified(RuntimeError):
    """The checkpoint's weights no longer match the sha256 recorded at training; the message names the file."""


# the flow-run form's defaults: the tiny preset (checkout-relative paths, so the default is portable)
DEFAULT_CONFIG = load_config("tiny")


def _config(config: PipelineConfig, overrides: dict[str, Any] | None) -> PipelineConfig:
    if not overrides:
        return config
    return validate_config(apply_overrides(config.model_dump(mode="json", by_alias=True), overrides))


def run_name() -> str:
    """The flow run's name: the run name, a short key of the effective config, and the start time (UTC), so runs
    of one preset are told apart and runs of the same settings share the key."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    config = _config(PipelineConfig.model_validate(params["config"]), params.get("overrides"))
    key = sha256_json(config.model_dump(mode="json"))[:6]
    started = flow_run.scheduled_start_time.strftime("%m%d-%H%M%S") if flow_run.scheduled_start_time else ""
    shard = f"shard{params['shard_start']}" if "shard_start" in params else ""
    return "-".join(filter(None, [config.run_name, shard, key, started]))


PREPARE_REGENERATED = "prepare-regenerated"  # the prepare task again, as a stage of its own (folder, key, UI name)


def _stages(config: PipelineConfig) -> SimpleNamespace:
    """The stage tasks with this run's result storage (cache records + artifacts) attached; each task is named
    after its artifact's stage (tasks.common.stage_task)."""
    storage = result_storage_block(config.result_storage_path)

    def stored(t, **options):
        return t.with_options(result_storage=storage, **options)

    return SimpleNamespace(
        prepare=stored(prepare_data_task), plan=stored(plan_capacity_task), regenerate=stored(regenerate_task),
        prepare_regenerated=stored(prepare_data_task, name=PREPARE_REGENERATED),
        extract=stored(extract_hidden_states_task), vocab=stored(build_vocab_task), train=stored(train_draft_task),
        validate=stored(validate_draft_task))


def _front(config: PipelineConfig, s: SimpleNamespace, regenerated_only_if_cached: bool = False):
    """prepare -> capacity plan (-> regenerate -> prepare the regenerated conversations). With
    ``regenerated_only_if_cached`` the regeneration must already be done (a shard flow must not regenerate the
    whole dataset on every host: run the eagle3-prepare flow once first)."""
    verifier = describe_verifier_task(config.verifier)
    sources = describe_sources_task(config.sources)
    prepare, chat = config.prepare_config(), config.chat_settings()
    tokenizer = describe_tokenizer_task(chat)
    prepared = run_stage(s.prepare, cfg=prepare, sources=sources, tokenizer=tokenizer, run_dir=config.run_dir)
    regen_cfg = config.regenerate_config()
    plan = run_stage(s.plan, cfg=config.capacity, extract=config.extract_config(), verifier=verifier,
                     prepared=prepared, regenerate=regen_cfg, training=config.training_shape(),
                     validate=config.validate_config, run_dir=config.run_dir)
    regenerated = None
    if regen_cfg.enabled:
        regenerated = run_stage(s.regenerate, cfg=regen_cfg, prepare=prepare, verifier=verifier,
                                prepared=prepared, run_dir=config.run_dir, host=config.host,
                                reuse_only=regenerated_only_if_cached, baseline_for=config.validate_config)
        prepare_regen = prepare.model_copy(update={"sources": [regenerated.conversations_path], "format": "openai",
                                                   "shuffle_seed": None, "max_samples": None})
        prepared = run_stage(s.prepare_regenerated, cfg=prepare_regen,
                             sources=describe_regenerated_task([regenerated.conversations_path]), tokenizer=tokenizer,
                             run_dir=config.run_dir)
    return verifier, prepared, plan, chat, tokenizer, regenerated


@flow(name="eagle3-pipeline", flow_run_name=run_name)
def eagle3_pipeline(config: PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    """Chat data + verifier -> trained EAGLE-3 draft, validated in vLLM. Every stage is cached by content."""
    config = _config(config, overrides)
    s = _stages(config)
    verifier, prepared, plan, chat, tokenizer, regenerated = _front(config, s)
    store = run_stage(s.extract, cfg=config.extract_config(), verifier=verifier, prepared=prepared,
                      plan=plan, run_dir=config.run_dir, host=config.host)
    vocab = run_stage(s.vocab, cfg=config.vocab, verifier=verifier, prepared=prepared,
                      run_dir=config.run_dir)
    checkpoint = run_stage(s.train, cfg=config.train_config(), store=store, vocab=vocab,
                           run_dir=config.run_dir, host=config.host, placement=config.placement)
    prompts = describe_prompts_task([resolve_path(config.validate_config.prompts_path)])
    report = run_stage(s.validate, cfg=config.validate_config, checkpoint=checkpoint, prompts=prompts,
                       chat=chat, tokenizer=tokenizer, regenerated=regenerated, run_dir=config.run_dir,
                       host=config.host)
    summary = {"run_dir": config.run_dir, "checkpoint": checkpoint.checkpoint_dir, "report": report.report_md,
               "verdict": report.verdict, "mean_acceptance_length": report.mean_acceptance_length,
               "untrained_mean_acceptance_length": report.untrained_mean_acceptance_length,
               "decode_speedup": report.decode_speedup, "weights_sha256": checkpoint.weights_sha256}
    modified = check_weights(checkpoint.checkpoint_dir or "", checkpoint.weights_sha256).problem
    artifacts.run_summary(summary, checkpoint, report, problem=modified)  # after the check: never a stale "ready"
    if modified:
        raise CheckpointModified(modified)
    if report.verdict != "pass":  # the run ends Failed (alerts fire), after every artifact and report exists
        raise DraftValidationFailed(f"the draft {checkpoint.checkpoint_dir} failed validation: "
                                    f"{'; '.join(report.reasons)} (report: {report.report_md})")
    return summary


@flow(name="eagle3-extract", flow_run_name=run_name)
def eagle3_extract(config: PipelineConfig = DEFAULT_CONFIG, shard_start: int = 0, shard_end: int | None = None,
                   overrides: dict[str, Any] | None = None) -> dict:
    """Prepare + plan + extract only, for the dataset's samples [shard_start, shard_end) (sample indices; None = to
    the end). Several GPU hosts each take a shard through their own work queue; all shards fill one store."""
    config = _config(config, overrides)
    s = _stages(config)
    verifier, prepared, plan, *_ = _front(config, s, regenerated_only_if_cached=True)
    extract = config.extract_config().model_copy(update={"shard_start": shard_start, "shard_end": shard_end})
    store = run_stage(s.extract, cfg=extract, verifier=verifier, prepared=prepared, plan=plan,
                      run_dir=config.run_dir, host=config.host)
    return store.model_dump(mode="json")


@flow(name="eagle3-prepare", flow_run_name=run_name)
def eagle3_prepare(config: PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    """Prepare + plan (+ regenerate + prepare the regenerated conversations) once, before the extraction shards of
    several hosts start: they find these stages cached (regeneration writes one dataset, not one per host)."""
    config = _config(config, overrides)
    _, prepared, plan, *_ = _front(config, _stages(config))
    return {"prepared": prepared.model_dump(mode="json"), "plan": plan.model_dump(mode="json")}


@flow(name="eagle3-train-validate", flow_run_name=run_name)
def eagle3_train_validate(config: PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    """Vocab + train + validate over the store that extraction (shards) filled. The same stages as the whole
    pipeline: prepare and plan are cache hits, and the extract stage only verifies the finished store (and fills any
    gap a failed shard left), so training never starts on a partial store."""
    return eagle3_pipeline.fn(config, overrides)


@flow(name="eagle3-train-node")  # its run keeps the name the coordinator gave it: <pipeline run>-node<rank>
def eagle3_train_node(cfg: TrainConfig, store: HiddenStates, vocab: VocabMapping, out_dir: str, node_rank: int,
                      host: HostConfig | None = None, address: str | None = None) -> dict:
    """One node of a multi-node training (train.nodes > 1), on the host whose work queue it was placed on. The train
    stage of a pipeline run starts one per node (tasks/nodes.py) and names each run after itself; not for starting
    by hand."""
    return train_node_task(cfg, store, vocab, out_dir, node_rank, host, address)


class PipelineCLI(BaseSettings):
    """python -m flows.eagle3_pipeline [--preset NAME] [--set KEY=VALUE ...]"""

    model_config = SettingsConfigDict(cli_prog_name="python -m flows.eagle3_pipeline", cli_kebab_case=False,
                                      env_prefix="EAGLE3_CLI_", cli_implicit_flags=True)

    preset: str = Field("tiny", description="A preset of prefect.yaml's definitions.presets.")
    set: list[str] = Field(default_factory=list, description="Override one setting, KEY=VALUE with a dotted key "
                           "(e.g. train.epochs=2; a JSON value, else a string); repeatable.")

    def cli_cmd(self) -> None:
        if self.preset not in preset_names():
            raise SystemExit(f"unknown preset {self.preset!r}; known: {', '.join(preset_names())}")
        try:
            config = load_config(self.preset, parse_set(self.set))
        except ConfigError as e:
            raise SystemExit(f"{e}") from None
        start_reaper()  # a kill -9 of this process must not leave Prefect's temporary API server running
        try:
            result = eagle3_pipeline(config)
        except (DraftValidationFailed, CheckpointModified) as e:  # the run ends Failed; never printed as ready
            print(f"\nFAILED: {e}")
            raise SystemExit(1) from None
        import json

        print("\n" + json.dumps(result, indent=2))
        mal, speedup = result.get("mean_acceptance_length"), result.get("decode_speedup")
        print(f"\nvLLM mean acceptance length: {'not measured' if mal is None else f'{mal:.3f}'} tokens per verifier "
              f"step; decoding speedup one request at a time: {'not measured' if speedup is None else f'{speedup:.2f}x'}"
              f" (the report has every concurrency level)")
        print(f"Draft checkpoint (vLLM-ready): {result['checkpoint']}\nValidation report: {result['report']}")


def split_set_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``--set VALUE`` / ``--set=VALUE`` taken out of ``argv`` verbatim: pydantic-settings would split a value at its
    commas and parse a JSON one (``data.sources=["a","b"]``) as a list of its own. -> (other args, set values)."""
    rest, values = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--set":
            value = next(args, None)
            if value is None:
                raise SystemExit("--set needs a KEY=VALUE after it")
            values.append(value)
        elif arg.startswith("--set="):
            values.append(arg[len("--set="):])
        else:
            rest.append(arg)
    return rest, values


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rest, values = split_set_args(sys.argv[1:] if argv is None else argv)
    CliApp.run(PipelineCLI, cli_args=rest, **({"set": values} if values else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The pipeline's configuration: one section per stage (each stage's own pydantic model), composed here.

Prefect renders this model as the flow-run form in the UI; every field carries a description with units, and the
fields the pipeline fills itself are hidden from the form (``SkipJsonSchema``). Presets (``definitions.presets`` in
prefect.yaml, also the deployments' parameters) are partial dicts merged over the defaults: ``tiny`` (the bundled
verifier, runs on a laptop), ``smollm2`` (a real instruct LLM on 2 CPU cores) and ``kimi-k2.5`` (the original
production run's choices). One-setting overrides (``{"train.epochs": 1}``, the CLI's ``--set train.epochs=1``) go
through ``apply_overrides``, validated like the rest.

Shared values are set once at the top (``verifier_path``, ``engine``: the vLLM engine settings, ``max_seq_len``) and
copied into the stage sections that need them, so the two cannot disagree; a stage's ``engine`` section holds only
its exceptions (validation's job timeout by default).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import SkipJsonSchema

from eagle3.capacity import CapacityConfig, TrainingShape
from eagle3.chat.encoder import ChatSettings
from eagle3.engine.settings import VALIDATE_TIMEOUT_S, EngineOverrides, EngineSettings
from eagle3.extract.config import ExtractConfig
from eagle3.prepare import PrepareConfig
from eagle3.regenerate.config import RegenerateConfig
from eagle3.support.gpu import LockSettings
from eagle3.support.paths import PREFECT_YAML, resolve_path
from eagle3.support.settings import RUNTIME, SETTINGS_MODEL
from eagle3.train.config import TrainConfig
from eagle3.validate.config import ValidateConfig
from eagle3.vocab import VocabConfig


class ConfigError(ValueError):
    """A preset, override or config value that cannot be used; the message names the key."""


class DataSection(PrepareConfig):
    sources: list[str] = Field(  # type: ignore[assignment]
        default_factory=lambda: ["data/stdlib-chat/train.openai.jsonl"], min_length=1,
        description=PrepareConfig.model_fields["sources"].description + " Relative paths: to the checkout.")
    tokenizer_path: str | None = Field(  # type: ignore[assignment]
        None, description="Tokenizer + chat template folder; None = the pipeline's verifier_path.")
    trust_remote_code: bool | None = Field(  # type: ignore[assignment]
        None, description="Allow the tokenizer's own Python code; None = the pipeline's engine.trust_remote_code "
        "(the verifier's tokenizer is the verifier's code).")
    # filled by the pipeline: hidden from the form and left out of dumps (a deployment's parameters never hold it)
    max_seq_len: SkipJsonSchema[int | None] = Field(  # type: ignore[assignment]
        None, exclude=True, description="Set from the pipeline's max_seq_len (tokens).")


_OVERRIDES = "This stage's exceptions to the pipeline's engine settings (fields left null are inherited)."


class ExtractSection(ExtractConfig):
    verifier: SkipJsonSchema[str | None] = Field(  # type: ignore[assignment]
        None, exclude=True, description="Set from the pipeline's verifier_path.")
    engine: EngineOverrides = Field(default_factory=EngineOverrides, description=_OVERRIDES)  # type: ignore


class RegenerateSection(RegenerateConfig):
    # filled from max_seq_len
    max_model_len: SkipJsonSchema[int | None] = Field(None, exclude=True)  # type: ignore[assignment]
    engine: EngineOverrides = Field(default_factory=EngineOverrides, description=_OVERRIDES)  # type: ignore


class ValidateSection(ValidateConfig):
    engine: EngineOverrides = Field(  # type: ignore[assignment]
        default_factory=lambda: EngineOverrides(timeout_s=VALIDATE_TIMEOUT_S),
        description=f"{_OVERRIDES} Validation's engine jobs time out after {VALIDATE_TIMEOUT_S:.0f} s by default.")


class TrainSection(TrainConfig):
    max_seq_len: int | None = Field(  # type: ignore[assignment]
        None, description="Packed sequence length in tokens; None = the pipeline's max_seq_len.")


class HostConfig(LockSettings):
    """The GPU host's guards: the Prefect global concurrency limit (slots = GPUs) and the host file lock. Every stage
    that uses the GPUs (extraction, training, vLLM validation, regeneration) holds both (tasks/common.py gpu_guard),
    occupying one slot per device it uses (at least one, on CPU too)."""

    model_config = SETTINGS_MODEL

    gpu_concurrency_limit: str | None = Field(
        None, description="Name of the Prefect global concurrency limit of this host (slots = GPUs), made by "
        "deployments/setup_prefect.sh. None = no limit (laptop demo, no server).", json_schema_extra=RUNTIME)
    strict: bool = Field(
        False, description="Fail when the limit does not exist instead of running unguarded (true in deployments).",
        json_schema_extra=RUNTIME)


class NodeHost(BaseModel):
    """One host of a multi-node training: where its node's flow run goes and which guard it takes there."""

    model_config = SETTINGS_MODEL

    work_queue: str = Field(description="The work queue this host's worker polls (deployments/start_worker.sh POOL "
                            "QUEUE): the node's flow run is placed on it.", json_schema_extra=RUNTIME)
    gpu_concurrency_limit: str | None = Field(
        None, description="This host's Prefect global concurrency limit (slots = its GPUs; deployments/"
        "setup_prefect.sh POOL LIMIT GPUS); None = host.gpu_concurrency_limit. Give each host its own: one limit "
        "shared by two hosts makes the second node wait for slots the first holds.", json_schema_extra=RUNTIME)
    address: str | None = Field(
        None, description="The address the other hosts reach this one at (torch elastic's local_addr; node 0's is "
        "where workers find the process group's store); None = this host's fully qualified name.",
        json_schema_extra=RUNTIME)


class NodePlacement(BaseModel):
    """Where a multi-node training (train.nodes > 1) runs: the train stage starts one flow run of ``deployment`` per
    host, node 0 first, each on its host's work queue, waits for all of them, and fails (cancelling the others) when
    one fails. Placement never changes what is trained."""

    model_config = SETTINGS_MODEL

    deployment: str = Field(
        "eagle3-train-node/train-node", description="The deployment that runs one node (flow eagle3-train-node, "
        "registered by `prefect deploy` from prefect.yaml); its work pool must hold every host's work queue.",
        json_schema_extra=RUNTIME)
    hosts: list[NodeHost] = Field(
        default_factory=list, description="One entry per node, node 0 first (node 0 hosts the rendezvous at "
        "train.rdzv_endpoint and writes the run's files). Needed when train.nodes > 1; exactly train.nodes entries.",
        json_schema_extra=RUNTIME)
    poll_seconds: float = Field(2.0, gt=0, description="Seconds between two reads of the node runs' states.",
                                json_schema_extra=RUNTIME)


class PipelineConfig(BaseModel):
    """Chat data + a verifier checkpoint -> an EAGLE-3 draft checkpoint that vLLM loads, with measured acceptance."""

    model_config = ConfigDict(**SETTINGS_MODEL, populate_by_name=True)

    run_name: str = Field("tiny-demo", description="Name of the run: its folder under runs_dir and the start of "
                          "the flow-run name.")
    runs_dir: str = Field("runs", description="Folder that holds one sub-folder per run (relative: to the checkout).")
    result_storage: str | None = Field(
        None, description="Where Prefect persists task results (small JSON artifacts) and cache records: a local "
        "folder or an fsspec URL (s3://bucket/prefix). None = the runs_dir's .prefect-results folder.")
    verifier_path: str = Field(
        "models/tiny-chat-verifier", description="Verifier checkpoint folder (Hugging Face layout; relative: to the "
        "checkout). Kimi-K2.5's nested text_config and language_model. prefix are understood.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="How the verifier runs in vLLM, for "
                                   "every stage that starts an engine (regeneration, vLLM extraction, validation); "
                                   "a stage's own engine section holds only its exceptions.")
    max_seq_len: int = Field(
        2048, ge=16, description="Longest sample in tokens: longer ones are skipped by data prep (counted), and the "
        "trainer packs samples into sequences of this length.")
    data: DataSection = Field(default_factory=DataSection,
                              description="Stage 1: chat datasets -> token ids + assistant-only loss masks.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig, description="Disk and time plan before "
                                     "regeneration and extraction.")
    regenerate: RegenerateSection = Field(default_factory=RegenerateSection, description="Stage 1b: the verifier "
                                          "rewrites the assistant turns (on-policy training data).")
    extract: ExtractSection = Field(default_factory=ExtractSection, description="Stage 2: verifier hidden states.")
    vocab: VocabConfig = Field(default_factory=VocabConfig, description="Stage 3: draft vocabulary (d2t / t2d).")
    train: TrainSection = Field(default_factory=TrainSection, description="Stage 4: the draft, training-time test.")
    validate_: ValidateSection = Field(default_factory=ValidateSection, alias="validate",
                                      description="Stage 5: checkpoint contract + vLLM speculative decoding.")
    host: HostConfig = Field(default_factory=HostConfig, description="GPU host guards (concurrency slots, lock).")
    placement: NodePlacement = Field(default_factory=NodePlacement, description="Multi-node training "
                                     "(train.nodes > 1): the host of each node.")

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if self.train.max_seq_len is not None and self.train.max_seq_len < self.max_seq_len:
            raise ValueError(f"train.max_seq_len ({self.train.max_seq_len} tokens) < max_seq_len "
                             f"({self.max_seq_len} tokens): a kept sample would not fit a packed sequence")
        if self.train.nodes > 1 and len(self.placement.hosts) != self.train.nodes:
            raise ValueError(f"placement.hosts lists {len(self.placement.hosts)} host(s) but train.nodes is "
                             f"{self.train.nodes}: give one work queue per node, node 0 first")
        if self.train.nodes > 1 and (problem := self.train.world_problem()):
            raise ValueError(f"train.{problem}")
        return self

    # --- the stage configs, with the shared values filled in

    # Paths stay as written (presets ship checkout-relative paths, portable between machines) and are resolved here.

    @property
    def verifier(self) -> str:
        return resolve_path(self.verifier_path)

    @property
    def sources(self) -> list[str]:
        return [resolve_path(s) for s in self.data.sources]

    def prepare_config(self) -> PrepareConfig:
        d = self.data.model_dump()
        d.update(sources=self.sources, tokenizer_path=resolve_path(self.data.tokenizer_path or self.verifier_path),
                 max_seq_len=self.max_seq_len, trust_remote_code=self.engine.trust_remote_code
                 if self.data.trust_remote_code is None else self.data.trust_remote_code)
        return PrepareConfig.model_validate(d)

    def chat_settings(self) -> ChatSettings:
        """What renders conversations (tokenizer, template override): one set for prepare, regeneration and
        validation."""
        return self.prepare_config().chat_settings()

    def engine_for(self, section: RegenerateSection | ExtractSection | ValidateSection) -> EngineSettings:
        """The engine settings a stage runs with: the pipeline's, with the section's own exceptions."""
        return self.engine.merged(section.engine)

    def regenerate_config(self) -> RegenerateConfig:
        return RegenerateConfig.model_validate({
            **self.regenerate.model_dump(exclude={"engine"}), "max_model_len": self.max_seq_len,
            "engine": self.engine_for(self.regenerate)})

    def extract_config(self) -> ExtractConfig:
        return ExtractConfig.model_validate({**self.extract.model_dump(exclude={"engine"}), "verifier": self.verifier,
                                             "engine": self.engine_for(self.extract)})

    def training_shape(self) -> TrainingShape:
        """What the capacity plan reads of training: the time estimate's epochs, split, batch, nodes x GPUs and draft
        size, and the verifier layer the draft starts from (checked before extraction)."""
        t = self.train
        return TrainingShape(epochs=t.epochs, val_ratio=t.val_ratio, batch_size=t.batch_size, nodes=t.nodes,
                             nproc=t.nproc, draft_vocab_size=self.vocab.draft_vocab_size, draft=t.draft,
                             init_from_layer=t.init_from_layer)

    def train_config(self) -> TrainConfig:
        return TrainConfig.model_validate({**self.train.model_dump(),
                                           "max_seq_len": self.train.max_seq_len or self.max_seq_len})

    @property
    def validate_config(self) -> ValidateConfig:
        return ValidateConfig.model_validate({**self.validate_.model_dump(exclude={"engine"}),
                                              "engine": self.engine_for(self.validate_)})

    @property
    def run_dir(self) -> str:
        return str(Path(resolve_path(self.runs_dir, must_exist=False)) / self.run_name)

    @property
    def result_storage_path(self) -> str:
        if self.result_storage:
            return resolve_path(self.result_storage, must_exist=False)
        return str(Path(resolve_path(self.runs_dir, must_exist=False)) / ".prefect-results")


# ---------------------------------------------------------------------------------------------------- presets


def _presets() -> dict[str, dict]:
    if not PREFECT_YAML.is_file():
        raise ConfigError(f"presets live in {PREFECT_YAML}, which is missing (the library was installed outside a "
                          f"checkout: pass a full config instead of a preset name)")
    return yaml.safe_load(PREFECT_YAML.read_text())["definitions"]["presets"]


def preset_names() -> list[str]:
    return sorted(_presets())


def load_preset_dict(name: str) -> dict:
    presets = _presets()
    if name not in presets:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(sorted(presets))}; see {PREFECT_YAML})")
    return copy.deepcopy(presets[name])


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with each dotted key of ``overrides`` set (``{"train.epochs": 1}``; a nested dict value merges
    into the section). Hand code because no library sets dotted paths into a plain dict: 20 lines."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        node = out
        *parents, leaf = str(key).strip().split(".")
        for part in parents:
            if not isinstance(node.setdefault(part, {}), dict):
                raise ConfigError(f"override {key!r}: {part!r} is a setting, not a section")
            node = node[part]
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = apply_overrides(node[leaf], value)
        else:
            node[leaf] = copy.deepcopy(value)
    return out


def load_config(preset: str = "tiny", overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """The preset with ``overrides`` (dotted keys or nested dicts) applied; one ConfigError naming the field."""
    return validate_config(apply_overrides(load_preset_dict(preset), overrides or {}))


def validate_config(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid pipeline config: " + "; ".join(lines)) from None


def parse_set(assignments: list[str]) -> dict[str, Any]:
    """``["train.epochs=2", 'data.sources=["a.jsonl"]']`` -> ``{"train.epochs": 2, "data.sources": ["a.jsonl"]}``:
    a value is JSON when it parses as JSON, else the plain string (pydantic converts "2" where a number is due)."""
    out: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out

"""The pipeline's configuration: one section per stage (each stage's own pydantic model), composed here.

Prefect renders this model as the flow-run form in the UI; every field carries a description with units. Presets
(``definitions.presets`` in prefect.yaml, also the deployments' parameters) are partial dicts deep-merged over the defaults: ``tiny`` (the bundled verifier,
runs on a laptop) and ``kimi-k2.5`` (the original production run's choices).

Shared values are set once at the top (``verifier_path``, ``max_seq_len``) and copied into the stage sections that
need them, so the two cannot disagree.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3.capacity import CapacityConfig
from eagle3.extract.config import ExtractConfig
from eagle3.prepare import PrepareConfig
from eagle3.support.paths import REPO_ROOT, resolve_path
from eagle3.support.verifier import VerifierSpec
from eagle3.train.trainer import TrainConfig
from eagle3.validate.stage import ValidateConfig
from eagle3.vocab import VocabConfig

PREFECT_YAML = REPO_ROOT / "prefect.yaml"  # presets live in its `definitions.presets`: one source of truth


class DataSection(PrepareConfig):
    sources: list[str] = Field(  # type: ignore[assignment]
        default_factory=lambda: ["data/stdlib-chat/train.openai.jsonl"], min_length=1,
        description=PrepareConfig.model_fields["sources"].description + " Relative paths: to the checkout.")
    tokenizer_path: str | None = Field(  # type: ignore[assignment]
        None, description="Tokenizer + chat template folder; None = the pipeline's verifier_path.")
    max_seq_len: int | None = Field(  # type: ignore[assignment]
        None, description="Set by the pipeline's max_seq_len (tokens); leave empty.")


class CapacitySection(CapacityConfig):
    store_dtype: str | None = Field(  # type: ignore[assignment]
        None, description="Set from extract.store_dtype (the store is planned in the dtype it is written in).")


class ExtractSection(ExtractConfig):
    verifier: str | None = Field(  # type: ignore[assignment]
        None, description="Set by the pipeline's verifier_path; leave empty.")


class TrainSection(TrainConfig):
    max_seq_len: int | None = Field(  # type: ignore[assignment]
        None, description="Packed sequence length in tokens; None = the pipeline's max_seq_len.")


class HostConfig(BaseModel):
    """The GPU host: the Prefect global concurrency limit that guards its GPUs (the host file lock guards them too)."""

    model_config = ConfigDict(extra="forbid")

    gpu_concurrency_limit: str | None = Field(
        None, description="Name of the Prefect global concurrency limit of this host (slots = GPUs), made by "
        "deployments/setup_prefect.sh. None = no limit (laptop demo, no server).")
    strict: bool = Field(
        False, description="Fail when the limit does not exist instead of running unguarded (true in deployments).")
    extraction_gpus: int = Field(
        1, ge=0, description="GPU slots extraction occupies (count): every GPU the verifier uses (Kimi-K2.5: 8).")
    training_gpus: int = Field(1, ge=0, description="GPU slots training occupies (count): its torchrun processes.")


class PipelineConfig(BaseModel):
    """Chat data + a verifier checkpoint -> an EAGLE-3 draft checkpoint that vLLM loads, with measured acceptance."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    run_name: str = Field("tiny-demo", description="Name of the run: its folder under runs_dir and the flow-run name.")
    runs_dir: str = Field("runs", description="Folder that holds one sub-folder per run (relative: to the checkout).")
    result_storage: str | None = Field(
        None, description="Where Prefect persists task results (small JSON manifests) and cache records: a local "
        "folder or an fsspec URL (s3://bucket/prefix). None = <runs_dir>/.prefect-results.")
    verifier_path: str = Field(
        "models/tiny-chat-verifier", description="Verifier checkpoint folder (Hugging Face layout; relative: to the "
        "checkout). Kimi-K2.5's nested text_config and language_model. prefix are understood.")
    max_seq_len: int = Field(
        2048, ge=16, description="Longest sample in tokens: longer ones are skipped by data prep (counted), and the "
        "trainer packs samples into sequences of this length.")
    data: DataSection = Field(description="Stage 1: chat datasets -> token ids + assistant-only loss masks.")
    capacity: CapacitySection = Field(default_factory=CapacitySection,
                                      description="Disk and time plan before extraction.")
    extract: ExtractSection = Field(default_factory=ExtractSection, description="Stage 2: verifier hidden states.")
    vocab: VocabConfig = Field(default_factory=VocabConfig, description="Stage 3: draft vocabulary (d2t / t2d).")
    train: TrainSection = Field(default_factory=TrainSection, description="Stage 4: the draft, training-time test.")
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate",
                                      description="Stage 5: checkpoint contract + vLLM speculative decoding.")
    host: HostConfig = Field(default_factory=HostConfig, description="GPU host concurrency settings.")

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if self.train.max_seq_len is not None and self.train.max_seq_len < self.max_seq_len:
            raise ValueError(f"train.max_seq_len ({self.train.max_seq_len} tokens) < max_seq_len "
                             f"({self.max_seq_len} tokens): a kept sample would not fit a packed sequence")
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
                 max_seq_len=self.max_seq_len)
        return PrepareConfig.model_validate(d)

    def capacity_config(self) -> CapacityConfig:
        store = self.extract.store_dtype
        dtype = VerifierSpec.from_path(self.verifier).dtype if store == "model" else store
        return CapacityConfig.model_validate({**self.capacity.model_dump(), "store_dtype": dtype})

    def extract_config(self) -> ExtractConfig:
        return ExtractConfig.model_validate({**self.extract.model_dump(), "verifier": self.verifier})

    def train_config(self) -> TrainConfig:
        return TrainConfig.model_validate({**self.train.model_dump(),
                                           "max_seq_len": self.train.max_seq_len or self.max_seq_len})

    @property
    def validate_config(self) -> ValidateConfig:
        return self.validate_

    @property
    def run_dir(self) -> str:
        return str(Path(resolve_path(self.runs_dir, must_exist=False)) / self.run_name)

    @property
    def result_storage_path(self) -> str:
        if self.result_storage:
            return resolve_path(self.result_storage, must_exist=False)
        return str(Path(resolve_path(self.runs_dir, must_exist=False)) / ".prefect-results")


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _presets() -> dict[str, dict]:
    return yaml.safe_load(PREFECT_YAML.read_text())["definitions"]["presets"]


def preset_names() -> list[str]:
    return sorted(_presets())


def load_preset_dict(name: str) -> dict:
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(sorted(presets))}; see {PREFECT_YAML})")
    return copy.deepcopy(presets[name])


def load_config(preset: str = "tiny", overrides: dict[str, Any] | None = None) -> PipelineConfig:
    return PipelineConfig.model_validate(deep_merge(load_preset_dict(preset), overrides or {}))


def parse_set(assignments: list[str]) -> dict[str, Any]:
    """``["train.epochs=2", "data.sources=[\\"a.jsonl\\"]"]`` -> nested dict; values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected dotted.key=value")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out

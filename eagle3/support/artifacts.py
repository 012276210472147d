"""What one stage hands the next: a small typed record (pydantic) of paths, content fingerprints and counts.

Each stage's artifact is defined once, beside the stage that writes it (``PreparedData`` in eagle3/prepare.py,
``CapacityPlan`` in eagle3/capacity.py, ``HiddenStates`` in eagle3/extract/stage.py, ``VocabMapping`` in
eagle3/vocab.py, ``DraftCheckpoint`` in eagle3/train/stage.py, ``ValidationReport`` in eagle3/validate/stage.py).
A stage function takes its config plus upstream artifacts and returns its artifact; the Prefect task returns it
unchanged, the flow passes it along, and the cache key of the next stage reads only its ``fingerprint`` (and the
fingerprints of the artifacts nested in it), never a path. Artifacts carry no tensors.

Every artifact is also written as ``<out_dir>/artifact.json``, so a stage folder says what it holds.

A cached artifact is reused only when ``problems()`` finds nothing: by default its outputs exist; each stage's
artifact adds the checks cheap enough for every reuse (file sizes; the sha256 of small files). What each checks and
what it costs: docs/DESIGN.md, "Caching".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Self

from eagle3.support.io import atomic_write_json, sha256_file

ARTIFACT_FILE = "artifact.json"
A = TypeVar("A", bound="Artifact")


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: ClassVar[str]

    out_dir: str = Field(description="The stage's output folder.")
    fingerprint: str = Field(description="sha256 over the content this stage wrote: what downstream cache keys read.")
    producer: str | None = Field(None, description="Who produced it (the orchestrator's run, when the pipeline "
                                 "ran the stage); not part of any key.")

    def outputs(self) -> list[str]:
        """Files and folders that must exist for this artifact to be reused (a cached result whose outputs were
        deleted is recomputed)."""
        return []

    def missing_outputs(self) -> list[str]:
        return [p for p in self.outputs() if not Path(p).exists()]

    def problems(self) -> list[str]:
        """Why this artifact cannot be reused as it is ([] = reusable): by default its missing outputs; stages add
        their integrity checks (a cached result with problems is recomputed: tasks/common.py ``run_stage``)."""
        return [f"{p} is missing" for p in self.missing_outputs()]

    def save(self) -> Path:
        return atomic_write_json(Path(self.out_dir) / ARTIFACT_FILE, self.model_dump(mode="json"))

    @classmethod
    def load(cls, out_dir: str | Path) -> Self:
        path = Path(out_dir) / ARTIFACT_FILE
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable {cls.__name__} artifact ({e})") from None


def file_problem(path: str | Path, sha256: str | None = None, size: int | None = None) -> str | None:
    """Why the file at ``path`` is not the one an artifact recorded (missing, another byte size, another sha256;
    ``None`` skips that check), or None when it is."""
    path = Path(path)
    if not path.is_file():
        return f"{path} is missing"
    if size is not None and path.stat().st_size != size:
        return f"{path} has {path.stat().st_size} bytes, {size} were recorded"
    if sha256 is not None and sha256_file(path) != sha256:
        return f"{path} changed since it was written (sha256 differs from the recorded one)"
    return None


def with_producer(artifact: A, producer: str) -> A:
    """The artifact stamped with its producer, re-saved (artifact.json says which run made the folder)."""
    stamped = artifact.model_copy(update={"producer": producer})
    stamped.save()
    return stamped


def identity(value: Any) -> Any:
    """What a cache key keeps of an artifact (or of any model with a ``fingerprint``): its fingerprint and those
    of the fingerprinted records nested in it (e.g. the verifier identity), never paths or counts."""
    out = {"fingerprint": value.fingerprint}
    for name in type(value).model_fields:
        sub = getattr(value, name)
        if isinstance(sub, BaseModel) and "fingerprint" in type(sub).model_fields:
            out[name] = identity(sub)
    return out

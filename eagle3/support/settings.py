"""Which settings change a stage's output: a flag on the field, read by cache keys, stage folders and resume.

Every stage setting is one of three kinds, marked where the field is defined (``json_schema_extra``):

* output (the default): changes what the stage writes. In the cache key, in the stage folder's key, and a resumed
  run must have the same value.
* ``RUNTIME``: never changes the output (progress cadence, batching, locks, devices, timeouts, interpreters). Out
  of the cache key and the folder key; a resumed run may change it.
* ``RESUMABLE``: selects how much of the output this invocation produces (an extraction shard's sample range, a
  time-boxed training job's step limit). In the cache key (another range is another result) but not in the folder
  key, so shards fill one store and a longer job resumes the shorter one's folder.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# every settings model's pydantic config: an unknown key is an error, and so is a float setting given as inf or NaN
# (`--set train.lr=inf` would otherwise train on NaN): one error naming the field
SETTINGS_MODEL = ConfigDict(extra="forbid", allow_inf_nan=False)

FLAG = "changes_output"
RUNTIME = {FLAG: False}
RESUMABLE = {FLAG: "resumable"}
# a nested settings model whose fields count as the parent's own in cache keys (the engine settings inside each
# stage's config: a stage's key is what it was before they moved into their own model)
INLINE = {"inline_in_key": True}


def kind(model: type[BaseModel] | BaseModel, name: str) -> str:
    """"output", "runtime" or "resumable" for field ``name`` of a settings model."""
    extra = (type(model) if isinstance(model, BaseModel) else model).model_fields[name].json_schema_extra
    flag = extra.get(FLAG, True) if isinstance(extra, dict) else True
    return "runtime" if flag is False else "resumable" if flag == "resumable" else "output"


def output_view(model: BaseModel, *, keep_resumable: bool) -> dict[str, Any]:
    """The model's JSON dump without its RUNTIME fields (and without RESUMABLE ones unless ``keep_resumable``);
    nested settings models are filtered the same way."""
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        k = kind(model, name)
        if k == "runtime" or (k == "resumable" and not keep_resumable):
            continue
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            inner = output_view(value, keep_resumable=keep_resumable)
            extra = type(model).model_fields[name].json_schema_extra
            if isinstance(extra, dict) and extra.get("inline_in_key"):
                out.update(inner)
            else:
                out[name] = inner
        else:
            out[name] = model.model_dump(mode="json", include={name})[name]
    return out

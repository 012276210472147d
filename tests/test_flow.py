"""The flow under a real (temporary) Prefect server: every stage cached on an unchanged rerun, a training setting
reruns only train + validate, a dataset change reruns everything; plus prefect.yaml and every shipped preset load.
(The deployment + worker path is tests/test_flow_e2e.py.)"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import BUNDLED_DATA, REPO

from eagle3.config import PipelineConfig, load_config, parse_set, preset_names

STAGES = ["prepare-data", "plan-capacity", "extract-hidden-states", "build-vocab", "train-draft", "validate-draft"]


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The session's temporary Prefect server (tests/conftest.py)."""
    yield


def _states(flow_state) -> dict[str, str]:
    """stage name -> state name of the flow run's task runs, read back through the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return {tr.name.rsplit("-", 1)[0]: tr.state.name for tr in runs}


def test_flow_caches_by_content(harness, tiny_llama_verifier, tmp_path):
    from flows.eagle3_pipeline import eagle3_pipeline

    data = tmp_path / "chats.jsonl"
    shutil.copy(BUNDLED_DATA / "eval.openai.jsonl", data)
    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(BUNDLED_DATA / "eval.openai.jsonl", prompts)
    base = {"verifier_path": str(tiny_llama_verifier), "runs_dir": str(tmp_path / "runs"),
            "data": {"sources": [str(data)], "max_samples": 24}, "vocab": {"draft_vocab_size": 256},
            "train": {"epochs": 1, "batch_size": 4},
            "validate": {"run_vllm": False, "compare_untrained": False, "offline_reference": False,
                         "min_mean_acceptance_length": None, "prompts_path": str(prompts)}}

    def run(overrides=None):
        state = eagle3_pipeline(load_config("tiny", {**base, **(overrides or {})}), return_state=True)
        assert state.is_completed(), state
        return _states(state), state.result()

    first, result = run()
    assert all(first[s] == "Completed" for s in STAGES), first
    assert Path(result["checkpoint"], "config.json").is_file()
    assert Path(result["report"]).is_file()

    again, result2 = run()
    assert all(again[s] == "Cached" for s in STAGES), again
    assert result2 == result

    lr, _ = run({"train": {"epochs": 1, "batch_size": 4, "lr": 1e-3}})
    assert [lr[s] for s in STAGES] == ["Cached"] * 4 + ["Completed"] * 2, lr

    prompts.write_text("\n".join(prompts.read_text().splitlines()[::-1]) + "\n")  # same path, new content
    edited, _ = run()
    assert [edited[s] for s in STAGES] == ["Cached"] * 5 + ["Completed"], edited

    with data.open("a") as f:  # new content in the same file: everything reruns
        f.write(json.dumps({"messages": [{"role": "user", "content": "What does len do?"},
                                         {"role": "assistant", "content": "Return the number of items."}]}) + "\n")
    changed, _ = run()
    assert all(changed[s] == "Completed" for s in STAGES), changed

    # outputs deleted behind the cache's back are recomputed, not returned stale
    shutil.rmtree(Path(result["run_dir"]))
    data.write_text(data.read_text())
    _, result3 = run({"data": {"sources": [str(data)], "max_samples": 24}})
    assert Path(result3["checkpoint"], "config.json").is_file()


def test_presets_and_prefect_yaml_deployments_load():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert set(preset_names()) >= {"tiny", "kimi-k2.5"}
    for name in preset_names():
        PipelineConfig.model_validate(load_config(name).model_dump(by_alias=True))
    kimi = load_config("kimi-k2.5")
    assert kimi.extract_config().aux_layer_ids == [2, 30, 58]
    assert kimi.vocab.draft_vocab_size == 32000 and kimi.max_seq_len == 2048
    assert kimi.data.max_samples == 1000 and "open-perfectblend" in kimi.data.sources[0]
    assert kimi.train.epochs == 10 and kimi.train.lr == 3e-5 and kimi.train.schedule == "cosine"
    assert kimi.train.val_ratio == 0.05
    assert kimi.extract.tensor_parallel_size == 8 and kimi.extract.backend == "vllm"

    import importlib

    for dep in spec["deployments"]:
        path, func = dep["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        params = dep.get("parameters", {})
        assert set(params) <= set(inspect.signature(flow.fn).parameters), dep["name"]
        PipelineConfig.model_validate(params["config"])
        assert dep["work_pool"]["name"] == "gpu-host"


def test_cli_overrides_parse():
    assert parse_set(["train.epochs=2", "data.sources=[a.jsonl]", "run_name=x"]) == {
        "train": {"epochs": 2}, "data": {"sources": ["a.jsonl"]}, "run_name": "x"}
    with pytest.raises(ValueError, match="dotted.key=value"):
        parse_set(["train.epochs"])
    with pytest.raises(ValueError, match="unknown preset"):
        load_config("nope")


def test_bad_pipeline_config_names_the_field():
    with pytest.raises(ValueError, match="train.max_seq_len"):
        load_config("tiny", {"train": {"max_seq_len": 64}})
    with pytest.raises(ValueError, match="not_a_field"):
        load_config("tiny", {"extract": {"not_a_field": 1}})


def test_config_reference_is_up_to_date():
    from eagle3.config_reference import render

    assert (REPO / "docs" / "CONFIG.md").read_text() == render(), "run: python -m eagle3.config_reference > docs/CONFIG.md"


@pytest.mark.vllm
def test_failed_validation_fails_the_flow_run_after_writing_the_report(harness, tiny_llama_verifier, tmp_path):
    """The conftest tiny Llama has head_dim 16, which vLLM's CPU attention cannot run: a real vLLM failure that
    becomes a 'fail' verdict, and the run must end Failed (alerts fire) with the report on disk."""
    from flows.eagle3_pipeline import eagle3_pipeline

    config = load_config("tiny", {
        "verifier_path": str(tiny_llama_verifier), "runs_dir": str(tmp_path / "runs"),
        "data": {"sources": [str(BUNDLED_DATA / "eval.openai.jsonl")], "max_samples": 16},
        "vocab": {"draft_vocab_size": 256}, "train": {"epochs": 1, "batch_size": 4},
        "validate": {"num_prompts": 1, "max_new_tokens": 4, "compare_untrained": False, "offline_reference": False}})
    state = eagle3_pipeline(config, return_state=True)
    assert state.is_failed()
    message = str(state.message)
    assert "failed validation" in message and "[vllm_failed]" in message
    report = Path(message.rsplit("(report: ", 1)[1].rstrip(")"))
    assert report.is_file() and "FAIL" in report.read_text()

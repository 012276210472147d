"""The flow under a real (temporary) Prefect server: every stage cached on an unchanged rerun, a training setting
reruns only train + validate, a dataset change reruns everything; plus prefect.yaml and every shipped preset load.
(The deployment + worker path is tests/test_flow_e2e.py.)"""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import BUNDLED_DATA, REPO

from eagle3.config import ConfigError, PipelineConfig, apply_overrides, load_config, parse_set, preset_names

STAGES = ["prepare-data", "plan-capacity", "extract-hidden-states", "build-vocab", "train-draft", "validate-draft"]


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The session's temporary Prefect server (tests/conftest.py)."""
    yield


def _states(flow_state, deadline_s: float = 60.0) -> dict[str, str]:
    """stage name -> final state name of the flow run's task runs, read back through the API. The server records
    task-run states asynchronously: wait (with a deadline) until every stage has reached a final state."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flt = FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=flt)
            states = {tr.name.rsplit("-", 1)[0]: tr.state for tr in runs if tr.state is not None}
            if all(s in states and states[s].is_final() for s in STAGES) or time.monotonic() > deadline:
                return {name: state.name for name, state in states.items()}
            time.sleep(0.2)


@pytest.mark.slow
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
        state = eagle3_pipeline(load_config("tiny", base), overrides=overrides, return_state=True)
        assert state.is_completed(), state
        return _states(state), state.result()

    first, result = run()
    assert all(first[s] == "Completed" for s in STAGES), first
    assert Path(result["checkpoint"], "config.json").is_file()
    assert Path(result["report"]).is_file()

    again, result2 = run()
    assert all(again[s] == "Cached" for s in STAGES), again
    assert result2 == result

    lr, _ = run({"train.lr": 1e-3})  # a one-setting override
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
    _, result3 = run()
    assert Path(result3["checkpoint"], "config.json").is_file()


def test_presets_and_prefect_yaml_deployments_load():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert set(preset_names()) >= {"tiny", "kimi-k2.5"}
    for name in preset_names():
        PipelineConfig.model_validate(load_config(name).model_dump(by_alias=True))
    kimi = load_config("kimi-k2.5")
    assert kimi.extract_config().aux_layer_ids == [2, 30, 58]
    assert kimi.host.gpu_concurrency_limit == "gpu-host-gpus" and kimi.host.strict
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
        # every deployment, the tiny CPU smoke test too, occupies the host's GPU slots
        assert params["config"]["host"]["gpu_concurrency_limit"] == "gpu-host-gpus", dep["name"]


def test_cli_overrides_parse_and_merge():
    assert parse_set(["train.epochs=2", 'data.sources=["a.jsonl"]', "run_name=x"]) == {
        "train.epochs": 2, "data.sources": ["a.jsonl"], "run_name": "x"}
    with pytest.raises(ValueError, match="dotted.key=value"):
        parse_set(["train.epochs"])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("nope")
    merged = apply_overrides({"train": {"epochs": 3, "lr": 1.0}}, {"train.epochs": 1, "vocab": {"draft_vocab_size": 8}})
    assert merged == {"train": {"epochs": 1, "lr": 1.0}, "vocab": {"draft_vocab_size": 8}}
    cfg = load_config("tiny", parse_set(["train.epochs=1", "data.max_samples=20"]))  # "1" -> int by pydantic
    assert cfg.train.epochs == 1 and cfg.data.max_samples == 20 and cfg.train.lr == load_config("tiny").train.lr
    with pytest.raises(ConfigError, match="train.nope"):
        load_config("tiny", {"train.nope": 1})
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config("tiny", {"train.epochs": "many"})


def test_cli_runs_through_pydantic_settings(capsys):
    """The CLI's --help comes from the settings model (descriptions included); a bad preset is one clear line."""
    from flows.eagle3_pipeline import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--preset" in out and "--set" in out and "dotted key" in out
    with pytest.raises(SystemExit, match="unknown preset 'nope'"):
        main(["--preset", "nope"])


def test_pipeline_form_hides_fields_the_pipeline_fills_and_keeps_angle_brackets():
    from flows.eagle3_pipeline import eagle3_pipeline

    schema = json.dumps(eagle3_pipeline.parameters.model_dump())
    assert "Set from the pipeline" not in schema  # data.tokenizer_path / max_seq_len, extract.verifier: hidden
    descriptions = re.findall(r'"description": "((?:[^"\\]|\\.)*)"', schema)
    assert len(descriptions) > 50 and not [d for d in descriptions if "<" in d]  # the UI drops text in <...>


def test_bad_pipeline_config_names_the_field():
    with pytest.raises(ConfigError, match="train.max_seq_len"):
        load_config("tiny", {"train": {"max_seq_len": 64}})
    with pytest.raises(ValueError, match="not_a_field"):
        load_config("tiny", {"extract": {"not_a_field": 1}})


def test_config_reference_is_up_to_date():
    from eagle3.support.config_reference import render

    assert (REPO / "docs" / "CONFIG.md").read_text() == render(), "run: python -m eagle3.support.config_reference > docs/CONFIG.md"


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

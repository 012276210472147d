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
from helpers import BUNDLED_DATA, REPO

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
    assert kimi.extract.backend == "vllm"
    # one engine section: every stage that starts vLLM inherits tensor parallel 8 and remote code from it
    for engine in (kimi.extract_config().engine, kimi.regenerate_config().engine, kimi.validate_config.engine):
        assert engine.tensor_parallel_size == 8 and engine.trust_remote_code
    assert kimi.prepare_config().trust_remote_code  # the tokenizer's too
    assert kimi.validate_config.engine.timeout_s == 1800 and kimi.extract_config().engine.timeout_s == 0

    import importlib

    for dep in spec["deployments"]:
        path, func = dep["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        params = dep.get("parameters", {})
        assert set(params) <= set(inspect.signature(flow.fn).parameters), dep["name"]
        assert dep["work_pool"]["name"] == "gpu-host"
        if func == "eagle3_train_node":  # one node of a multi-node training: the train stage passes everything
            assert not params, dep["name"]
            continue
        config = PipelineConfig.model_validate(params["config"])
        # every deployment, the tiny CPU smoke tests too, occupies the GPU slots of its host(s): one host's, or
        # with several nodes each host its own limit (one shared limit would make node 1 wait for node 0's slots)
        if config.train.nodes == 1:
            assert config.host.gpu_concurrency_limit == "gpu-host-gpus", dep["name"]
        else:
            limits = [h.gpu_concurrency_limit for h in config.placement.hosts]
            assert len(set(limits)) == config.train.nodes and config.host.gpu_concurrency_limit == limits[0]
            assert dep["work_pool"]["work_queue_name"] == config.placement.hosts[0].work_queue, dep["name"]


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
    # --set values reach the config verbatim: commas and JSON lists included (one clear error for a bad key)
    with pytest.raises(SystemExit, match="data.nope"):
        main(["--set", 'data.sources=["a.jsonl","b.jsonl"]', "--set=train.epochs=2", "--set", "data.nope=1,2"])


@pytest.mark.slow
def test_cli_killed_hard_leaves_no_temporary_prefect_server(tmp_path):
    """`python -m flows.eagle3_pipeline` without PREFECT_API_URL starts Prefect's temporary API server (uvicorn) as
    its child; after a kill -9 of the flow process (no atexit runs) the reaper ends that server."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    flow = subprocess.Popen([sys.executable, "-m", "flows.eagle3_pipeline", "--preset", "tiny", "--set",
                             f"runs_dir={tmp_path / 'runs'}"], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = None
    try:
        deadline = time.monotonic() + 240
        while server is None:
            assert flow.poll() is None, flow.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no temporary Prefect server was started"
            server = next((c for c in psutil.Process(flow.pid).children(recursive=True)
                           if "uvicorn" in " ".join(c.cmdline())), None)
            time.sleep(0.2)
        time.sleep(2.5)  # the reaper polls the flow process's children every second
        os.kill(flow.pid, signal.SIGKILL)
        flow.wait(30)
        assert psutil.wait_procs([server], timeout=20)[1] == [], "the temporary server outlived the killed flow"
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait()
        if server is not None and server.is_running():
            server.kill()


def test_cli_set_values_are_taken_verbatim():
    from eagle3.config import parse_set
    from flows.eagle3_pipeline import split_set_args

    rest, values = split_set_args(["--preset", "tiny", "--set", 'data.sources=["a.jsonl","b.jsonl"]',
                                   "--set=train.lr=3e-5", "--set", "run_name=a,b"])
    assert rest == ["--preset", "tiny"]
    assert parse_set(values) == {"data.sources": ["a.jsonl", "b.jsonl"], "train.lr": 3e-5, "run_name": "a,b"}


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


def _float_settings(model: type, prefix: str = "") -> list[str]:
    """Dotted paths of every float setting under ``model`` (nested settings models followed, Optional unwrapped)."""
    import types
    import typing

    from pydantic import BaseModel

    out = []
    for attr, field in model.model_fields.items():
        name = field.alias or attr  # as a preset spells it (PipelineConfig.validate_ is "validate")
        union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
        args = typing.get_args(field.annotation) if union else (field.annotation,)
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        listed = [a for t in args for a in typing.get_args(t) if typing.get_origin(t) is list
                  and isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            out += _float_settings(nested[0], f"{prefix}{name}.")
        elif float in args:
            out.append(prefix + name)
        # a list of settings models (placement.hosts) cannot be reached by a dotted `--set`: none holds a float yet
        assert not any(_float_settings(m) for m in listed), f"{prefix}{name}: extend this walk to lists"
    return out


def test_every_float_setting_refuses_inf_and_nan_naming_the_field():
    paths = _float_settings(PipelineConfig)
    assert {"train.lr", "train.feature_noise", "capacity.disk_margin_fraction", "host.lock_wait_seconds"} <= set(paths)
    for path in paths:
        for bad in ("inf", "-inf", "nan"):  # what `--set KEY=inf` gives (parse_set keeps the string; pydantic reads it)
            with pytest.raises(ConfigError, match=rf"{re.escape(path)}: Input should be a finite number"):
                load_config("tiny", parse_set([f"{path}={bad}"]))
    with pytest.raises(ConfigError, match=r"train\.adam_betas\.0: Input should be a finite number"):  # inside a tuple
        load_config("tiny", parse_set(["train.adam_betas=[NaN, 0.95]"]))


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


# ---------------------------------------------------------------- what is on disk cannot be silently wrong


def _base(verifier: Path, tmp_path: Path) -> dict:
    """The small pipeline of these tests (24 samples, one epoch, validation without vLLM)."""
    data = tmp_path / "chats.jsonl"
    shutil.copy(BUNDLED_DATA / "eval.openai.jsonl", data)
    return {"verifier_path": str(verifier), "runs_dir": str(tmp_path / "runs"),
            "data": {"sources": [str(data)], "max_samples": 24}, "vocab": {"draft_vocab_size": 256},
            "train": {"epochs": 1, "batch_size": 4},
            "validate": {"run_vllm": False, "compare_untrained": False, "offline_reference": False,
                         "min_mean_acceptance_length": None,
                         "prompts_path": str(BUNDLED_DATA / "eval.openai.jsonl")}}


def _runs(flow_state, stages: list[str], deadline_s: float = 60.0) -> dict[str, list[str]]:
    """stage name -> the final states of its task runs in this flow run, oldest first (a cached result that
    fails its reuse check is recomputed: Cached, then Completed), read back through the API."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flt = FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            runs = sorted(client.read_task_runs(flow_run_filter=flt), key=lambda tr: tr.created)
            out: dict[str, list] = {}
            for tr in runs:
                if tr.state is not None:
                    out.setdefault(tr.name.rsplit("-", 1)[0], []).append(tr.state)
            if all(s in out and all(x.is_final() for x in out[s]) for s in stages) or time.monotonic() > deadline:
                return {name: [x.name for x in states] for name, states in out.items()}
            time.sleep(0.2)


def _run_summary(flow_state) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    flt = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_state.state_details.flow_run_id]),
                         key=ArtifactFilterKey(any_=["run-summary"]))
    with get_client(sync_client=True) as client:
        return "\n".join(str(a.data) for a in client.read_artifacts(artifact_filter=flt))


def _zero_64k(path: Path) -> None:
    """Zero 64 KiB in the middle of a file (its size unchanged): bytes silently wrong."""
    size = path.stat().st_size
    assert size > 2 * (64 << 10), (path, size)
    with open(path, "r+b") as f:
        f.seek(size // 2 - (32 << 10))
        f.write(bytes(64 << 10))


def _flatten(d: dict, prefix: str = "") -> list[str]:
    """--set KEY=VALUE arguments (dotted keys, JSON values) for a nested override dict."""
    out = []
    for k, v in d.items():
        out += _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={json.dumps(v)}"]
    return out


@pytest.mark.slow
def test_lost_manifest_reextracts_nothing_and_a_modified_checkpoint_fails_the_run(harness, tiny_llama_verifier,
                                                                                 tmp_path, capsys):
    """store/manifest.jsonl deleted with every sample file intact: extraction reruns (its reuse check fails),
    rebuilds the manifest from the files and extracts nothing; the store's fingerprint is unchanged, so training
    stays cached. Then 64 KiB zeroed inside the trained checkpoint's model.safetensors: the run fails naming the
    file and is never reported as vLLM-ready (neither in the run summary nor on the command line)."""
    from eagle3.extract.stage import HiddenStates
    from flows.eagle3_pipeline import PipelineCLI, eagle3_pipeline

    base = _base(tiny_llama_verifier, tmp_path)
    first = eagle3_pipeline(load_config("tiny", base), return_state=True)
    assert first.is_completed(), first
    result = first.result()
    (stage,) = Path(result["run_dir"]).glob("extract-hidden-states-*")
    before = HiddenStates.load(stage)

    (stage / "store" / "manifest.jsonl").unlink()
    again = eagle3_pipeline(load_config("tiny", base), return_state=True)
    assert again.is_completed(), again
    runs = _runs(again, STAGES)
    assert runs["extract-hidden-states"] == ["Cached", "Completed"], runs
    assert all(runs[s] == ["Cached"] for s in STAGES if s != "extract-hidden-states"), runs
    after = HiddenStates.load(stage)
    assert (after.samples_written, after.manifest_entries_rebuilt) == (0, before.samples_stored)
    assert after.fingerprint == before.fingerprint and again.result() == result

    weights = Path(result["checkpoint"]) / "model.safetensors"
    _zero_64k(weights)
    with pytest.raises(SystemExit) as e:  # the command line's own path (its argv parsing is tested above)
        PipelineCLI(preset="tiny", set=_flatten(base)).cli_cmd()
    out = capsys.readouterr().out
    assert e.value.code == 1 and f"FAILED: the draft checkpoint {weights} does not match the sha256" in out
    assert "vLLM-ready" not in out
    state = eagle3_pipeline(load_config("tiny", base), return_state=True)
    assert state.is_failed() and str(weights) in str(state.result(raise_on_failure=False))
    summary = _run_summary(state)
    assert "NOT ready to serve" in summary and "vLLM-ready" not in summary and str(weights) in summary


@pytest.mark.slow
def test_damaged_sample_fails_training_naming_it_and_the_rerun_repairs_it(harness, tiny_llama_verifier, tmp_path):
    """64 KiB zeroed inside one stored sample after extraction (same size: the reuse check passes), a sample of the
    run's LAST optimizer step: training saves its state step by step, refuses the sample on its first read and the
    run fails naming the file; the rerun extracts that sample again (only it: its states differ from the first ones
    by float rounding at most) and training RESUMES in the same folder from its saved state, because the store's
    identity is what was extracted, not its bytes: never trained on the damage, never failing the same way twice,
    never starting over."""
    from eagle3.draft.checkpoint import load_trainer_state
    from eagle3.extract.stage import HiddenStates
    from eagle3.store import HiddenStateStore
    from eagle3.train.data import BatchPlan, pack_samples, split_indices
    from flows.eagle3_pipeline import eagle3_extract, eagle3_pipeline

    base = _base(tiny_llama_verifier, tmp_path)
    base["train"].update(save_state_every_steps=1, batch_size=2)  # several steps, a saved state after each
    config = load_config("tiny", base)
    extracted = eagle3_extract(config, return_state=True)
    assert extracted.is_completed(), extracted
    store = HiddenStateStore(extracted.result()["store_path"])
    identity = HiddenStates.load(Path(store.path).parent).fingerprint
    t = config.train_config()  # the trainer's own plan: the rows of the run's last step
    train_idx, _ = split_indices(store.indices(), t.val_ratio, t.seed)
    rows = pack_samples({i: min(store.tokens(i), t.max_seq_len) for i in train_idx}, t.max_seq_len)
    plan = BatchPlan(rows, t.seed, t.batch_size, t.grad_accum_steps, 1, 0)
    steps = len(rows) // t.batch_size
    assert steps >= 2, steps
    last = [i for micro in plan.micro_bins(t.epochs - 1, steps - 1) for row in micro for i in row]
    victim = max(last, key=lambda i: store.file(i).stat().st_size)
    path = store.file(victim)
    _zero_64k(path)

    failed = eagle3_pipeline(config, return_state=True)
    assert failed.is_failed()
    error = str(failed.result(raise_on_failure=False))
    assert f"sample {victim} of store" in error and f"{path} does not match its manifest sha256" in error
    runs = _runs(failed, ["extract-hidden-states", "train-draft"])
    assert runs["extract-hidden-states"] == ["Cached"] and runs["train-draft"] == ["Failed"], runs
    (train_dir,) = Path(config.run_dir).glob("train-draft-*")
    saved_at = load_trainer_state(train_dir / "latest")["progress"]["global_step"]
    assert 1 <= saved_at < steps  # trained up to the damaged step, state saved

    repaired = eagle3_pipeline(config, return_state=True)
    assert repaired.is_completed(), repaired
    runs = _runs(repaired, STAGES)
    assert runs["extract-hidden-states"] == ["Cached", "Completed"] and runs["train-draft"] == ["Completed"], runs
    artifact = HiddenStates.load(Path(store.path).parent)
    assert (artifact.samples_written, artifact.manifest_entries_dropped) == (1, 1)
    assert artifact.fingerprint == identity  # the repair kept the store's identity ...
    assert list(Path(config.run_dir).glob("train-draft-*")) == [train_dir]  # ... hence training's folder
    records = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r["global_step"] for r in records if r["event"] == "train"]
    assert steps_logged == sorted(set(steps_logged)) and steps_logged[-1] == steps  # resumed, each step once
    HiddenStateStore(store.path).verify()


def test_missing_verifier_says_verifier_not_found_at_every_entry(harness, tmp_path):
    """A verifier path that does not exist is "verifier not found: <path>" from the flow (its describe step) and
    from each stage function, never a Hugging Face repo-id error."""
    from eagle3.chat.errors import DataError
    from eagle3.extract.stage import extract_hidden_states
    from eagle3.prepare import PrepareConfig, prepare_data
    from eagle3.support.verifier import VerifierError
    from eagle3.train.config import TrainConfig
    from eagle3.train.stage import train_draft
    from flows.eagle3_pipeline import eagle3_pipeline

    missing = tmp_path / "models" / "no-such-verifier"
    state = eagle3_pipeline(load_config("tiny", _base(missing, tmp_path)), return_state=True)
    assert state.is_failed()
    assert f"verifier not found: {missing} does not exist" in str(state.result(raise_on_failure=False))
    with pytest.raises(VerifierError, match=f"verifier not found: {missing} does not exist"):
        extract_hidden_states({"verifier": str(missing)}, tmp_path / "dataset", tmp_path / "store")
    with pytest.raises(VerifierError, match=f"verifier not found: {missing} does not exist"):
        train_draft(TrainConfig(), tmp_path / "store", tmp_path / "mapping.safetensors", tmp_path / "train",
                    verifier=missing)
    with pytest.raises(DataError, match=f"tokenizer not found: {missing} does not exist"):  # the verifier's
        prepare_data(PrepareConfig(sources=[str(BUNDLED_DATA / "eval.openai.jsonl")], tokenizer_path=str(missing),
                                   max_seq_len=512), tmp_path / "prepared")

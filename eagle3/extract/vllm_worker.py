"""vLLM-side driver of the vLLM extraction backend: ``python -m eagle3.extract.vllm_worker <job.json>``.

Runs in the vLLM environment (imports torch, safetensors, vllm and ``eagle3.store`` only). Started by
``eagle3.extract.vllm_backend`` in its own process group; the parent holds the GPU lock, watches the manifest for
progress and kills the whole group on timeout or cancel.

It prefills every sample once (``max_tokens=1``) with vLLM's ``extract_hidden_states`` speculative method. The
target returns the residual stream at ``aux_layer_ids + [L]`` (vLLM convention; id L = last layer's output before
the final norm), vLLM caches those per token, and ``Eagle3StoreConnector`` writes each finished sample into the
store. Prefix caching is OFF: a cached prefix would skip the forward of those tokens and their states.

Job file keys: verifier, aux_layer_ids, num_hidden_layers, store_dir, group_size, store_dtype, work_file
(safetensors: index [N] int64, offsets [N+1] int64, input_ids [sum T] int32, loss_mask [sum T] uint8),
dtype, max_num_batched_tokens, max_num_seqs, max_model_len, engine (the engine settings' ``vllm.LLM`` arguments),
chunk_samples, write_timeout_seconds, selfcheck (None, or index, tolerance and
result_file: the sample is first extracted alone, then second in the first chunk, whose requests all reach the paused
scheduler before its first step; the driver compares the two raw copies the connector keeps, with the layout of the
step that computed the batch copy (eagle3/extract/selfcheck.py), writes the result and stops with EXIT_SELFCHECK on a
mismatch).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eagle3.engine.exits import EXIT_INCOMPLETE, EXIT_SELFCHECK
from eagle3.store import read_manifest


def build_llm(job: dict):
    from vllm import LLM

    layer_ids = [*job["aux_layer_ids"], job["num_hidden_layers"]]  # the last id = final state, before the norm
    return LLM(
        model=job["verifier"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_num_seqs=job["max_num_seqs"],
        enable_prefix_caching=False,
        skip_tokenizer_init=True,  # prompts arrive as token ids; verifiers need not ship a tokenizer here
        disable_log_stats=True,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        kv_transfer_config={
            "kv_connector": "Eagle3StoreConnector",
            "kv_connector_module_path": "eagle3.extract.vllm_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "eagle3_store_dir": job["store_dir"],
                "eagle3_group_size": job["group_size"],
                "eagle3_store_dtype": job["store_dtype"],
                "eagle3_n_aux": len(job["aux_layer_ids"]),
                "num_writer_threads": 4,
            },
        },
        **job["engine"],  # the pipeline's engine settings (eagle3.engine.settings.EngineSettings.llm_kwargs)
    )


def main(job_path: str) -> int:
    from safetensors.torch import load_file
    from vllm import SamplingParams

    from eagle3.extract.vllm_connector import INDEX_KEY, LOSS_MASK_KEY, SELFCHECK_KEY

    job = json.loads(Path(job_path).read_text())
    work = load_file(job["work_file"])
    index, offsets = work["index"].tolist(), work["offsets"].tolist()
    input_ids, loss_mask = work["input_ids"], work["loss_mask"]
    llm = build_llm(job)
    check = job.get("selfcheck")

    def request(j: int, selfcheck: str = "") -> tuple[dict, SamplingParams]:
        s, e = offsets[j], offsets[j + 1]
        params = {INDEX_KEY: index[j], LOSS_MASK_KEY: loss_mask[s:e].tolist()}
        if selfcheck:
            params[SELFCHECK_KEY] = selfcheck
        return ({"prompt_token_ids": input_ids[s:e].tolist()},
                SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))

    if check:  # the check's sample alone, in a generate call of its own (the work file lists it second)
        t0 = time.monotonic()
        prompt, params = request(1, "alone")
        llm.generate([prompt], [params], use_tqdm=False)
    chunk = max(1, int(job["chunk_samples"]))
    for a in range(0, len(index), chunk):
        prompts, params = zip(*(request(j, "batch" if check and j == 1 else "")
                                for j in range(a, min(a + chunk, len(index)))))
        if check and a == 0:
            _generate_queued(llm, list(prompts), list(params))
        else:
            llm.generate(list(prompts), list(params), use_tqdm=False)
        if check and a == 0 and not _compare(job, check, time.monotonic() - t0):
            return EXIT_SELFCHECK
    # writes finish on the connector's threads: wait until the manifest lists every sample of this job
    want, deadline = set(index), time.monotonic() + float(job["write_timeout_seconds"])
    while True:
        missing = want - set(read_manifest(job["store_dir"], strict=False))
        if not missing:
            print(f"[eagle3-vllm] wrote {len(want)} samples", flush=True)
            return 0
        if time.monotonic() > deadline:
            print(f"[eagle3-vllm] {len(missing)} samples never reached the store, e.g. {sorted(missing)[:10]}",
                  file=sys.stderr, flush=True)
            return EXIT_INCOMPLETE
        time.sleep(0.2)


def _generate_queued(llm, prompts: list[dict], params: list) -> None:
    """``llm.generate`` with every request in the scheduler before the first forward step: the scheduler is paused
    (vLLM's sleep level 0: requests queue, nothing runs) while they are added. Else an engine core in its own process
    may start a step as soon as the first request arrives, and the self-check's sample, second in line, would be
    computed alone or first in a later step (seen on a loaded 2-core host: the check compared identical copies)."""
    engine = llm.llm_engine
    llm.sleep(level=0, mode="keep")
    for k, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"selfcheck-chunk-{k}", prompt, param)
    llm.wake_up(tags=["scheduling"])
    while engine.has_unfinished_requests():
        engine.step()


def _compare(job: dict, check: dict, seconds: float) -> bool:
    """Compare the raw copies of the check's sample (alone, in the batch) once the connector wrote both; write the
    result file. False when the states differ beyond the tolerance. The batch size compared is the number of
    requests the engine put in the forward step that computed the batch copy (the connector records it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eagle3.extract import selfcheck
    from eagle3.extract.vllm_connector import STEP_LAYOUT, selfcheck_file
    from eagle3.support.io import atomic_write_json

    files = [selfcheck_file(job["store_dir"], kind, check["index"]) for kind in ("batch", "alone")]
    deadline = time.monotonic() + float(job["write_timeout_seconds"])
    while not all(f.is_file() for f in files):
        if time.monotonic() > deadline:
            raise RuntimeError(f"self-check copies never reached the disk: {[str(f) for f in files]}")
        time.sleep(0.1)
    n_aux = len(job["aux_layer_ids"])
    batch, alone = (load_file(str(f))["states"] for f in files)  # [T, n_aux + 1, H] each
    with safe_open(str(files[0]), "pt") as f:
        step_requests, tokens_ahead = (int((f.metadata() or {})[k]) for k in STEP_LAYOUT)
    record = selfcheck.check(
        check["index"], step_requests, (batch[:, :n_aux].flatten(1), batch[:, n_aux]),
        (alone[:, :n_aux].flatten(1), alone[:, n_aux]), job["aux_layer_ids"], job["dtype"], "vllm", seconds,
        check["tolerance"], tokens_ahead)
    atomic_write_json(check["result_file"], record)
    print(f"[eagle3-vllm] {selfcheck.summary(record)}", flush=True)
    return record["passed"] is not False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

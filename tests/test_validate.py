"""Structural validation of draft checkpoints: a good checkpoint written by eagle3.draft.checkpoint passes, and a corpus of
deliberately broken ones (each written as real config.json + model.safetensors files) is each caught with its own
code and a message naming what is wrong. Report files (JSON, markdown, PNG) from a report dict."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import vocab_tables
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from eagle3.draft.checkpoint import save_draft
from eagle3.draft.config import DraftArchitecture, DraftConfig
from eagle3.draft.model import Eagle3Draft
from eagle3.support.io import sha256_file
from eagle3.support.verifier import VerifierSpec
from eagle3.validate.config import ValidateConfig
from eagle3.validate.contract import validate_checkpoint
from eagle3.validate.report import render_markdown, write_report
from tasks.validate import validate_checkpoint_task, validate_draft_task

DRAFT_VOCAB = 512
AUX = [1, 2, 3]  # vLLM convention: residual stream entering layers 1, 2, 3 of the 4-layer tiny verifier


def make_draft(verifier: Path, out: Path, **cfg_overrides) -> Path:
    """A real checkpoint folder, written by eagle3.draft.checkpoint.save_draft."""
    spec = VerifierSpec.from_path(verifier)
    cfg = DraftConfig.build(spec, DRAFT_VOCAB, AUX, torch_dtype="float32")
    if cfg_overrides:
        cfg = DraftConfig.model_validate({**cfg.model_dump(), **cfg_overrides})
    d2t, t2d = vocab_tables(cfg.vocab_size, cfg.draft_vocab_size)
    if cfg.hidden_size == spec.hidden_size:
        draft = Eagle3Draft.from_verifier(cfg, verifier, d2t, t2d)
    else:
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return save_draft(out, cfg, draft.state_dict(), {"verifier": str(verifier)})


def rewrite(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with ``config(dict)`` / ``tensors(dict)`` applied (they mutate in place)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    ts = load_file(str(dst / "model.safetensors"))
    if config:
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if tensors:
        tensors(ts)
        save_file({k: v.contiguous() for k, v in ts.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def good(tiny_llama_verifier, tmp_path_factory) -> Path:
    return make_draft(tiny_llama_verifier, tmp_path_factory.mktemp("good") / "draft")


def test_good_checkpoint_passes_with_summary(good, tiny_llama_verifier):
    rep = validate_checkpoint(good, tiny_llama_verifier)
    assert rep.ok, rep.failures
    assert rep.warnings == []
    s = rep.summary
    assert s["aux_layer_ids"] == AUX and s["draft_vocab_size"] == DRAFT_VOCAB and s["vocab_size"] == 8192
    assert s["dtype"] == "float32" and s["embed_tokens_in_checkpoint"] is False and s["num_parameters"] > 0
    json.dumps(rep.to_dict())  # JSON-serialisable


def _pop_top_aux(c):
    del c["eagle_aux_hidden_state_layer_ids"]


def _pop_inner_aux(c):
    del c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def _set_aux(top, inner):
    def f(c):
        c["eagle_aux_hidden_state_layer_ids"] = top
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = inner
    return f


def _nest(c):
    inner = {k: c.pop(k) for k in list(c) if k not in ("architectures",)}
    c["text_config"] = inner


def _set(key, value):
    def f(c):
        c[key] = value
    return f


def _drop(name):
    def f(t):
        del t[name]
    return f


def _flip_t2d(t):
    i = int(torch.nonzero(~t["t2d"])[0])  # a target id outside the draft vocab becomes "in" it
    t["t2d"][i] = True


def _nan(t):
    t["midlayer.mlp.up_proj.weight"][3, 5] = float("nan")


def _inf(t):
    t["norm.weight"][0] = float("inf")


def _fc_wrong(t):
    t["fc.weight"] = t["fc.weight"][:, : 2 * 64].clone()  # two aux states' worth instead of three


def _lm_head_rows(t):
    t["lm_head.weight"] = t["lm_head.weight"][: DRAFT_VOCAB - 12].clone()


def _prefix(t):
    for k in list(t):
        t["model." + k] = t.pop(k)


def _extra(t):
    t["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(8)


def _bf16(t):
    t["midlayer.mlp.down_proj.weight"] = t["midlayer.mlp.down_proj.weight"].to(torch.bfloat16)


def _d2t_out_of_range(t):
    t["d2t"][-1] = 10_000


def _d2t_dup(t):
    t["d2t"][1] = t["d2t"][0] - 1  # draft id 1 -> the same target id as draft id 0


def _d2t_int32(t):
    t["d2t"] = t["d2t"].to(torch.int32)


def _t2d_uint8(t):
    t["t2d"] = t["t2d"].to(torch.uint8)


def _eagle_opt(key):
    def f(c):
        c["eagle_config"][key] = True
    return f


# (id, config mutation, tensor mutation, expected failure codes, words the message must contain)
CORPUS = [
    ("nested_config", _nest, None, ["config_nested"], ["text_config", "FLAT"]),
    ("aux_missing_top_level", _pop_top_aux, None, ["aux_ids_missing_top_level"], ["top level"]),
    ("aux_missing_eagle_config", _pop_inner_aux, None, ["aux_ids_missing_eagle_config"], ["eagle_config"]),
    ("aux_top_vs_eagle_config", _set_aux([1, 2, 3], [0, 1, 2]), None, ["aux_ids_mismatch"], ["[1, 2, 3]", "[0, 1, 2]"]),
    ("aux_out_of_range", _set_aux([1, 2, 4], [1, 2, 4]), None, ["aux_ids_out_of_range"], ["[4]", "vLLM convention"]),
    ("aux_not_ascending", _set_aux([3, 2, 1], [3, 2, 1]), None, ["aux_ids_not_ascending"], ["ascending"]),
    ("aux_not_list", _set_aux("1,2,3", "1,2,3"), None, ["aux_ids_invalid"], ["list of integers"]),
    ("aux_empty", _set_aux([], []), None, ["aux_ids_empty"], ["at least one auxiliary layer"]),
    ("use_aux_false", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None,
     ["use_aux_hidden_state_false"], ["use_aux_hidden_state"]),
    ("norm_before_fc_without_its_norm", _eagle_opt("norm_before_fc"), None, ["tensors_missing"],
     ["input_norm.weight"]),
    ("parallel_drafting", _eagle_opt("use_parallel_drafting"), None, ["unsupported_option"], ["use_parallel_drafting"]),
    ("draft_vocab_size", _set("draft_vocab_size", 600), None, ["draft_vocab_size_mismatch"], ["600", "512"]),
    ("draft_vocab_gt_vocab", _set("draft_vocab_size", 9000), None,
     ["draft_vocab_size_too_large", "draft_vocab_size_mismatch"], ["9000"]),
    ("vocab_size", _set("vocab_size", 8000), None, ["vocab_size_mismatch"], ["8000", "8192"]),
    ("target_hidden_size", _set("target_hidden_size", 128), None, ["target_hidden_size_mismatch", "fc_shape"],
     ["128", "64"]),
    ("architectures", _set("architectures", ["LlamaForCausalLM"]), None, ["architectures"], ["LlamaForCausalLMEagle3"]),
    ("model_type", _set("model_type", "deepseek_v3"), None, ["model_type"], ["llama"]),
    ("two_layers", _set("num_hidden_layers", 2), None, ["num_hidden_layers"], ["one decoder layer"]),
    ("missing_key", lambda c: c.pop("intermediate_size"), None, ["config_missing_keys"], ["intermediate_size"]),
    ("rope_yarn", _set("rope_parameters", {"rope_type": "yarn", "factor": 4.0}), None, ["unsupported_option"],
     ["yarn"]),
    ("dtype_declared", _set("torch_dtype", "bfloat16"), None, ["dtype_mismatch"], ["float32", "bfloat16"]),
    ("d2t_missing", None, _drop("d2t"), ["d2t_missing"], ["no d2t", "target id i"]),
    ("t2d_missing", None, _drop("t2d"), ["t2d_missing"], ["t2d"]),
    ("t2d_inconsistent", None, _flip_t2d, ["t2d_inconsistent"], ["arange", "513 true"]),
    ("t2d_dtype", None, _t2d_uint8, ["t2d_dtype"], ["uint8"]),
    ("d2t_out_of_range", None, _d2t_out_of_range, ["d2t_out_of_range"], ["draft id 511"]),
    ("d2t_not_unique", None, _d2t_dup, ["d2t_not_unique"], ["same target id"]),
    ("d2t_dtype", None, _d2t_int32, ["d2t_dtype"], ["int32", "int64"]),
    ("fc_shape", None, _fc_wrong, ["fc_shape"], ["fc.weight", "(64, 128)", "(64, 192)"]),
    ("nan_weight", None, _nan, ["nonfinite"], ["midlayer.mlp.up_proj.weight (1 values)"]),
    ("inf_norm", None, _inf, ["nonfinite"], ["norm.weight"]),
    ("lm_head_rows", None, _lm_head_rows, ["lm_head_shape"], ["lm_head.weight", "(500, 64)", "512"]),
    ("model_prefix", None, _prefix, ["names_prefixed"], ["model.", "prefix"]),
    ("missing_tensor", None, _drop("midlayer.hidden_norm.weight"), ["tensors_missing"], ["midlayer.hidden_norm"]),
    ("unexpected_tensor", None, _extra, ["tensors_unexpected"], ["rotary_emb.inv_freq"]),
    ("mixed_dtypes", None, _bf16, ["dtype_mismatch"], ["bfloat16", "float32"]),
]


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_broken_checkpoint_is_caught_with_its_own_message(case, good, tiny_llama_verifier, tmp_path):
    name, config, tensors, codes, words = case
    broken = rewrite(good, tmp_path / name, config, tensors)
    rep = validate_checkpoint(broken, tiny_llama_verifier)
    assert not rep.ok
    assert rep.codes == codes, [f"{f.code}: {f.message}" for f in rep.failures]
    message = rep.failures[0].message
    for w in words:
        assert w in message, (w, message)
    json.dumps(rep.to_dict())


def test_mla_draft_contract(kimi_shaped, tmp_path):
    """An MLA draft (vLLM's Eagle3DeepseekV3ForCausalLM) passes the contract beside a Kimi-shaped verifier; its own
    failure modes are named: the deepseek_v3 model type (vLLM turns it into DeepSeek's MTP module), an input norm
    vLLM's MLA draft does not have, and, on a CPU, a llama draft beside the MLA verifier."""
    spec = VerifierSpec.from_path(kimi_shaped)
    cfg = DraftConfig.build(spec, DRAFT_VOCAB, None, DraftArchitecture(kind="mla", fc_norm=True),
                            torch_dtype="float32")
    d2t, t2d = vocab_tables(cfg.vocab_size, cfg.draft_vocab_size)
    draft = Eagle3Draft.from_verifier(cfg, kimi_shaped, d2t, t2d)
    mla = save_draft(tmp_path / "mla", cfg, draft.state_dict(), {"verifier": str(kimi_shaped)})
    rep = validate_checkpoint(mla, kimi_shaped)
    assert rep.ok, rep.failures
    v3 = rewrite(mla, tmp_path / "v3", lambda c: c.update(model_type="deepseek_v3"))
    assert validate_checkpoint(v3, kimi_shaped).codes == ["model_type"]
    assert "MTP" in validate_checkpoint(v3, kimi_shaped).failures[0].message
    with_norm = rewrite(mla, tmp_path / "norm", _eagle_opt("norm_before_fc"))
    assert validate_checkpoint(with_norm, kimi_shaped).codes == ["unsupported_option"]
    llama_cfg = DraftConfig.build(spec, DRAFT_VOCAB, None, torch_dtype="float32")
    llama = save_draft(tmp_path / "llama", llama_cfg,
                       Eagle3Draft.from_verifier(llama_cfg, kimi_shaped, d2t, t2d).state_dict(), {})
    codes = validate_checkpoint(llama, kimi_shaped).codes
    assert codes == ([] if torch.cuda.is_available() else ["serving_pair_unsupported"])


def test_corpus_cases_are_distinct():
    assert len({c[0] for c in CORPUS}) == len(CORPUS)


def test_embedding_absent_requires_verifier_width(tiny_llama_verifier, tmp_path):
    # a consistent draft of width 128 over a width-64 verifier: valid only with its own embedding
    wide = make_draft(tiny_llama_verifier, tmp_path / "wide", hidden_size=128)
    rep = validate_checkpoint(wide, tiny_llama_verifier)
    assert rep.codes == ["embed_shared_hidden_mismatch"], rep.failures
    assert "128" in rep.failures[0].message and "64" in rep.failures[0].message

    def add_embedding(t):
        t["embed_tokens.weight"] = torch.randn(8192, 128)

    with_embed = rewrite(wide, tmp_path / "wide-embed", tensors=add_embedding)
    assert validate_checkpoint(with_embed, tiny_llama_verifier).ok

    def bad_embedding(t):
        t["embed_tokens.weight"] = torch.randn(8192, 64)

    rep = validate_checkpoint(rewrite(wide, tmp_path / "wide-bad-embed", tensors=bad_embedding), tiny_llama_verifier)
    assert rep.codes == ["shape_mismatch"] and "embed_tokens.weight" in rep.failures[0].message


def test_layers_0_spelling_loads_like_midlayer(good, tiny_llama_verifier, tmp_path):
    def respell(t):
        for k in [k for k in t if k.startswith("midlayer.")]:
            t["layers.0." + k.removeprefix("midlayer.")] = t.pop(k)

    rep = validate_checkpoint(rewrite(good, tmp_path / "respelled", tensors=respell), tiny_llama_verifier)
    assert rep.ok, rep.failures


def test_missing_files_and_folders(good, tiny_llama_verifier, tmp_path):
    assert validate_checkpoint(tmp_path / "nope", tiny_llama_verifier).codes == ["draft_dir_missing"]
    no_weights = rewrite(good, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    assert validate_checkpoint(no_weights, tiny_llama_verifier).codes == ["weights_missing"]
    no_config = rewrite(good, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    assert validate_checkpoint(no_config, tiny_llama_verifier).codes == ["config_missing"]
    bad_json = rewrite(good, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    assert validate_checkpoint(bad_json, tiny_llama_verifier).codes == ["config_invalid_json"]
    garbage = rewrite(good, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    assert validate_checkpoint(garbage, tiny_llama_verifier).codes == ["weights_unreadable"]
    no_run = rewrite(good, tmp_path / "no-run-info")
    (no_run / "eagle3_run.json").unlink()
    rep = validate_checkpoint(no_run, tiny_llama_verifier)
    assert rep.ok and [w.code for w in rep.warnings] == ["run_info_missing"]
    assert validate_checkpoint(good, tmp_path / "no-verifier").codes == ["verifier_unreadable"]


def test_several_failures_are_all_listed(good, tiny_llama_verifier, tmp_path):
    def cfg(c):
        del c["eagle_aux_hidden_state_layer_ids"]
        c["model_type"] = "mistral"

    rep = validate_checkpoint(rewrite(good, tmp_path / "many", cfg, _nan), tiny_llama_verifier)
    assert rep.codes == ["model_type", "aux_ids_missing_top_level", "nonfinite"]


def test_draft_for_a_kimi_like_nested_verifier(kimi_like_target, tmp_path):
    """The verifier side is read through its nested text_config (Kimi-K2.5 layout); the draft stays flat (an MLA
    draft: the kind vLLM serves beside an MLA verifier on any platform)."""
    spec = VerifierSpec.from_path(kimi_like_target)
    cfg = DraftConfig.build(spec, 256, [2, 3, 5], DraftArchitecture(kind="mla"), torch_dtype="float32")
    d2t, t2d = vocab_tables(spec.vocab_size, 256)
    draft = Eagle3Draft.from_verifier(cfg, kimi_like_target, d2t, t2d)
    folder = save_draft(tmp_path / "kimi-draft", cfg, draft.state_dict(), {"verifier": str(kimi_like_target)})
    rep = validate_checkpoint(folder, kimi_like_target)
    assert rep.ok, rep.failures
    assert rep.summary["verifier_layers"] == 6 and rep.summary["aux_layer_ids"] == [2, 3, 5]
    rep = validate_checkpoint(rewrite(folder, tmp_path / "kimi-bad", _set_aux([2, 3, 6], [2, 3, 6])), kimi_like_target)
    assert rep.codes == ["aux_ids_out_of_range"] and "6 layers" in rep.failures[0].message


def _sample_report(verdict: str = "pass") -> dict:
    acc = {"num_speculative_tokens": 3, "num_drafts": 40, "num_draft_tokens": 120, "num_accepted_tokens": 50,
           "accepted_per_pos": [25, 15, 10], "mean_acceptance_length": 2.25,
           "per_position_acceptance": [0.625, 0.375, 0.25], "draft_acceptance_rate": 50 / 120}
    return {"format": "eagle3-validation/1", "draft_dir": "/x/draft", "verifier_path": "/x/verifier",
            "prompts_path": "/x/eval.jsonl", "settings": ValidateConfig().model_dump(mode="json"),
            "structural": {"ok": True, "failures": [], "warnings": [],
                           "summary": {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 512}},
            "vllm": {"acceptance": acc, "lossless": True, "num_prompts": 8, "vllm_version": "0.32.0",
                     "untrained": {"acceptance": {**acc, "mean_acceptance_length": 1.1,
                                                  "per_position_acceptance": [0.1, 0.0, 0.0]}}},
            "offline": {"acceptance": {**acc, "mean_acceptance_length": 2.3}, "relative_difference": 0.05/2.25},
            "verdict": verdict, "reasons": [] if verdict == "pass" else ["[not_lossless] outputs differ"]}


def test_write_report_files(tmp_path):
    paths = write_report(tmp_path / "validate", _sample_report())
    assert set(paths) == {"report_json", "report_md", "acceptance_png"}
    assert Path(paths["acceptance_png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = json.loads(Path(paths["report_json"]).read_text())
    assert back["paths"] == paths and back["verdict"] == "pass"
    md = Path(paths["report_md"]).read_text()
    assert "| figure | vLLM | vLLM, untrained draft | offline reference |" in md
    assert "| mean acceptance length | 2.25 | 1.10 | 2.30 |" in md  # 3 significant digits (eagle3.support.display)
    assert "| acceptance at position 3 | 0.250 | 0 | 0.250 |" in md
    assert "**PASS**" in md and "acceptance.png" in md


def test_report_without_vllm_has_no_png_and_lists_reasons(tmp_path):
    rep = _sample_report("fail")
    rep["vllm"] = {"skipped": "the checkpoint failed the structural check"}
    rep.pop("offline")
    paths = write_report(tmp_path / "v", rep)
    assert "acceptance_png" not in paths and not (tmp_path / "v" / "acceptance.png").exists()
    md = render_markdown({**rep, "paths": paths})
    assert "**FAIL**" in md and "[not_lossless] outputs differ" in md and "not run: the checkpoint failed" in md


def _speed(levels: list[tuple[int, list[float], list[float]]], schedule: str = "ABBA") -> dict:
    """report.json's ``vllm.speed`` as eagle3.validate.vllm_check.speed_summary writes it (+ the stage's repeats)."""
    from eagle3.validate.vllm_check import speed_summary

    rounds = {who: [{"concurrency": c, "requests": max(8, 2 * c), "output_tokens_per_second": x, "load_1min": 1.5}
                    for c, a, b in levels for x in (a if who == "A" else b)] for who in "AB"}
    return {"repeats": 1, **speed_summary(schedule, [c for c, _, _ in levels], rounds["A"], rounds["B"], 4)}


def test_report_flags_a_speedup_whose_repeats_disagree():
    """The tiny demo at load 4 printed a 20.7x speedup from repeats of 30-660 tok/s: such a figure is flagged."""
    rep = _sample_report()
    rep["vllm"]["speed"] = _speed([(1, [100.0, 104.0, 98.0], [95.0, 97.0, 99.0])])
    md = render_markdown(rep)
    assert "| 1 | 8 | 100, 104, 98.0 | 95.0, 97.0, 99.0 | **1.03x** |" in md and "not reliable" not in md
    rep["vllm"]["speed"] = _speed([(1, [100.0, 104.0], [95.0, 97.0]), (4, [30.0, 620.0, 660.0], [30.0, 31.0, 29.0])])
    md = render_markdown(rep)
    assert "| 4 | 8 | 30.0, 620, 660 | 30.0, 31.0, 29.0 | 20.7x |" in md
    assert "at 4 in flight the repeats ranged 30-660 tok/s with the draft, 29-31 tok/s without" in md
    assert "order ABBA (4 engine starts" not in md  # the stage records the starts beside the speed, not in it
    rep["vllm"]["engine_starts"] = 4
    assert "in the order ABBA (4 engine starts in all)" in render_markdown(rep)


def test_speed_summary_per_concurrency_level():
    """Issue 17: the speedup per concurrency level (medians of every timed decode of each engine), the first level the
    headline, repeated at the top level."""
    sp = _speed([(1, [15.0, 14.0], [10.0, 11.0]), (4, [30.0, 32.0], [34.0, 33.0])])
    assert [lv["concurrency"] for lv in sp["levels"]] == [1, 4]
    assert sp["speedup"] == sp["levels"][0]["speedup"] == 14.5 / 10.5
    assert sp["levels"][1]["speedup"] == 31.0 / 33.5
    assert sp["concurrency"] == 1 and sp["draft_output_tokens_per_second"] == [15.0, 14.0]
    assert sp["levels"][0]["load_1min"] == [1.5, 1.5] and sp["levels"][1]["requests"] == 8


def test_speed_requests_repeat_the_prompts_to_twice_the_concurrency():
    from eagle3.validate.vllm_check import speed_requests

    prompts = [[1], [2], [3]]
    assert speed_requests(prompts, 1) == prompts
    assert speed_requests(prompts, 4) == [[1], [2], [3], [1], [2], [3], [1], [2]]


def test_speed_settings_refuse_bad_schedules_and_levels():
    for bad in ({"speed_schedule": "AA"}, {"speed_schedule": "BB"}, {"speed_schedule": "AXB"},
                {"speed_concurrency": [1, 1]}, {"speed_concurrency": [0]}, {"speed_concurrency": []}):
        with pytest.raises(ValidationError):
            ValidateConfig(**bad)
    assert ValidateConfig(speed_schedule="ABBA", speed_concurrency=[1, 4, 16]).speed_schedule == "ABBA"


def _criteria(report: dict, cfg: ValidateConfig, recorded: str | None = "a" * 64) -> dict[str, dict]:
    from eagle3.validate.verdict import judge

    criteria, reasons = judge({"weights_sha256": "a" * 64, **report}, cfg, "/x/draft/model.safetensors", recorded)
    return {c.name: c.model_dump() for c in criteria}, reasons


def test_verdict_states_each_criterion_with_what_it_requires_and_the_value_measured():
    """Issue 20: a PASS at mean acceptance length 1.10 said nothing of what was required. Each criterion now says
    what passes (or that no threshold is set) and the value measured beside it, rounded for people."""
    rep = _sample_report()
    rep["vllm"].update(num_prompts=8, mismatches=[], speed=_speed(
        [(1, [47.41, 23.0, 84.0], [53.71, 51.0, 73.0]), (4, [40.0], [50.0])]))
    cfg = ValidateConfig(compare_untrained=True, offline_reference=True)  # no min_mean_acceptance_length
    by, reasons = _criteria(rep, cfg)
    assert reasons == []
    assert by["mean acceptance length (vLLM)"] == {
        "name": "mean acceptance length (vLLM)", "required": "no threshold set (validate.min_mean_acceptance_length)",
        "measured": "2.25 tokens per verifier step", "result": "not gated"}
    assert by["lossless at temperature 0"]["required"] == "identical outputs (validate.require_lossless)"
    assert by["lossless at temperature 0"]["measured"].startswith("yes: all 8 outputs identical")
    assert by["lossless at temperature 0"]["result"] == "met"
    assert by["gain over the untrained draft"]["measured"] == "+1.15 (2.25 trained vs 1.10 untrained)"
    assert by["offline reference agrees with vLLM"]["measured"] == "2.22% apart (offline 2.30, vLLM 2.25)"
    assert by["offline reference agrees with vLLM"]["required"].startswith("mean acceptance lengths within 10%")
    assert by["decoding speedup"]["measured"].startswith("0.883x at one request at a time: 47.4 output tokens/s with "
                                                         "the draft vs 53.7 without; 0.800x at 4 (medians")
    assert "not reliable" in by["decoding speedup"]["measured"] and by["decoding speedup"]["result"] == "not gated"
    assert by["weights are the ones trained"]["result"] == "met"
    assert by["checkpoint files match vLLM's contract"]["measured"] == "ok"

    by, reasons = _criteria(rep, ValidateConfig(min_mean_acceptance_length=3.0, compare_untrained=False))
    assert by["mean acceptance length (vLLM)"]["required"] == "at least 3 (validate.min_mean_acceptance_length)"
    assert by["mean acceptance length (vLLM)"]["result"] == "NOT met"
    assert reasons == ["[below_threshold] vLLM mean acceptance length 2.250 < min_mean_acceptance_length 3.0"]
    assert by["gain over the untrained draft"] == {
        "name": "gain over the untrained draft", "required": "not compared (validate.compare_untrained is off)",
        "measured": "not measured", "result": "not checked"}
    assert by["offline reference agrees with vLLM"]["result"] == "not checked"

    rep["vllm"].update(lossless=False, mismatches=[{"prompt": 3, "first_difference_at_token": 7}])
    by, reasons = _criteria(rep, ValidateConfig())
    assert by["lossless at temperature 0"]["result"] == "NOT met"
    assert reasons == [("[not_lossless] speculative and plain greedy outputs differ on 1 of 8 prompts (first: prompt 3 "
                        "at token 7)")]
    by, reasons = _criteria(rep, ValidateConfig(require_lossless=False))
    assert by["lossless at temperature 0"]["result"] == "not gated" and reasons == []

    by, reasons = _criteria(rep, ValidateConfig(), recorded="b" * 64)  # weights changed since training
    assert by["weights are the ones trained"]["result"] == "NOT met" and reasons[0].startswith("[weights_modified]")


def test_report_opens_with_the_verdict_and_its_criteria(tmp_path):
    from eagle3.validate.verdict import judge

    rep = _sample_report()
    rep["vllm"].update(num_prompts=8, mismatches=[])
    criteria, reasons = judge({"weights_sha256": "a" * 64, **rep}, ValidateConfig(), "/x/model.safetensors", None)
    rep.update(criteria=[c.model_dump() for c in criteria], reasons=reasons)
    md = render_markdown(rep)
    head = md.split("## Checkpoint contract")[0]
    assert "**PASS: 3 criteria met; reported without a threshold: mean acceptance length (vLLM)" in head
    assert "| criterion | required | measured | result |" in head
    assert ("| mean acceptance length (vLLM) | no threshold set (validate.min_mean_acceptance_length) | "
            "2.25 tokens per verifier step | not gated |") in head
    assert "not checked: weights are the ones trained" in head  # a plain folder: no hash recorded at training


def test_run_summary_states_the_verdict_its_criteria_and_rounded_figures(tmp_path):
    """Issue 20: run-summary said PASS at "1.1031390134529149" and "untrained draft: None", without a criterion."""
    from eagle3.validate.stage import ValidationReport
    from eagle3.validate.verdict import judge
    from tasks.artifacts import for_people, run_summary_markdown

    rep = _sample_report()
    rep["vllm"].update(num_prompts=8, mismatches=[])
    rep["vllm"].pop("untrained")
    rep["vllm"]["acceptance"]["mean_acceptance_length"] = 1.1031390134529149
    cfg = ValidateConfig()  # compare_untrained off, no threshold
    criteria, reasons = judge({"weights_sha256": "a" * 64, **rep}, cfg, "/x/model.safetensors", "a" * 64)
    rep.update(criteria=[c.model_dump() for c in criteria], reasons=reasons)
    paths = write_report(tmp_path, rep)
    report = ValidationReport(
        out_dir=str(tmp_path), fingerprint=sha256_file(paths["report_json"]), report_json=paths["report_json"],
        report_md=paths["report_md"], acceptance_png=None, vllm_log=None, checkpoint_dir="/x/draft",
        weights_sha256="a" * 64, verdict="pass", reasons=[], criteria=criteria, structural_ok=True, failure_codes=[],
        lossless=True, mean_acceptance_length=1.1031390134529149, per_position_acceptance=None,
        untrained_mean_acceptance_length=None, offline_mean_acceptance_length=None,
        offline_relative_difference=None, decode_speedup=None)
    summary = {"run_dir": "/x", "checkpoint": "/x/draft", "report": paths["report_md"], "verdict": "pass",
               "mean_acceptance_length": 1.1031390134529149, "untrained_mean_acceptance_length": None,
               "weights_sha256": "a" * 64}
    checkpoint = type("Checkpoint", (), {"producer": None})()  # run_summary_markdown reads only its producer
    md = run_summary_markdown(summary, checkpoint, report)
    assert md.startswith("# EAGLE-3 run: PASS")
    assert "**Validation: PASS: 4 criteria met; reported without a threshold: mean acceptance length (vLLM)" in md
    assert "| mean acceptance length (vLLM) | 1.10 tokens per verifier step; no threshold set |" in md
    assert "| untrained draft | not measured (validate.compare_untrained is off) |" in md
    assert "| lossless at temperature 0 | identical outputs (validate.require_lossless) |" in md
    assert "1.1031" not in md and "None" not in md
    from tasks.artifacts import TABLE_CELL_CHARS
    from tasks.validate import acceptance_rows

    rows = for_people(acceptance_rows(report))  # a table cell does not wrap in the UI: short cells, one page of 10
    assert len(rows) <= 10 and all(len(cell) <= TABLE_CELL_CHARS for row in rows for cell in row.values()), rows
    assert rows[0] == {"figure": "verdict", "value": "PASS (4 met, 2 not gated, 2 not checked)"}, rows
    assert {"figure": "mean acceptance length (vLLM)", "value": "1.10 tokens per verifier step"} in rows
    assert {"figure": "mean acceptance length, untrained draft", "value": "not measured"} in rows
    assert for_people([{"metric": "sim accept", "value": 1.2126719199790643}, {"metric": "x", "value": None},
                       {"metric": "tokens", "value": 11828}]) == [
        {"metric": "sim accept", "value": "1.21"}, {"metric": "x", "value": "not measured"},
        {"metric": "tokens", "value": "11,828"}]


def test_validate_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValueError):
        ValidateConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError):
        ValidateConfig(speculative_tokens=3)
    with pytest.raises(ValueError):
        ValidateConfig(min_mean_acceptance_length=0.5)  # below 1 token per step: not a length


def test_task_structural_only_pass_and_fail(good, tiny_llama_verifier, tmp_path):
    cfg = ValidateConfig(run_vllm=False)
    m = validate_checkpoint_task.fn(cfg, str(good), str(tiny_llama_verifier), None, str(tmp_path / "ok"))
    assert m.verdict == "pass" and m.structural_ok and m.failure_codes == [] and len(m.model_dump_json()) < 20_000
    assert m.mean_acceptance_length is None and len(m.weights_sha256) == 64
    assert m.acceptance_png is None and all(Path(p).is_file() for p in m.outputs())
    assert m.report()["vllm"] == {"skipped": "run_vllm is false"}

    broken = rewrite(good, tmp_path / "broken", tensors=_drop("d2t"))
    m = validate_checkpoint_task.fn(ValidateConfig(), str(broken), str(tiny_llama_verifier), None,
                                    str(tmp_path / "bad"))
    assert m.verdict == "fail" and m.failure_codes == ["d2t_missing"]
    assert m.reasons[0].startswith("[d2t_missing]")
    assert m.report()["vllm"]["skipped"] == "the checkpoint failed the structural check"  # vLLM never started
    assert "`d2t_missing`" in Path(m.report_md).read_text()


def _checkpoint_artifact(folder: Path, verifier: Path, weights_sha256: str):
    from eagle3.support.verifier import describe_verifier
    from eagle3.train.stage import DraftCheckpoint

    return DraftCheckpoint(
        out_dir=str(folder.parent), fingerprint="c" * 64, checkpoint_dir=str(folder), weights_sha256=weights_sha256,
        config_sha256=None, verifier=describe_verifier(verifier), aux_layer_ids=[1, 2, 3], draft_vocab_size=64,
        best_epoch=1, best_sim_accept_len=1.0, epoch_checkpoints=[str(folder)], latest_state=str(folder),
        metrics_path=str(folder / "config.json"), plots=[], final_val=None, untrained_val=None, epochs_done=1,
        global_step=1, total_steps=1, tokens_seen=1, packing_efficiency=1.0, train_rows=1, val_rows=0,
        truncated_samples=0, stopped_early=False, nproc=1, wall_s=0.0)


def test_pipeline_stage_task_writes_into_its_stage_folder(good, tiny_llama_verifier, tmp_path):
    from eagle3.chat.sources import describe_sources
    from eagle3.support.paths import BUNDLED_DATA

    checkpoint = _checkpoint_artifact(good, tiny_llama_verifier, sha256_file(good / "model.safetensors"))
    prompts = describe_sources([str(BUNDLED_DATA / "eval.openai.jsonl")])
    m = validate_draft_task.fn(ValidateConfig(run_vllm=False), checkpoint, prompts, str(tmp_path / "run"))
    assert Path(m.out_dir).parent == tmp_path / "run" and Path(m.out_dir).name.startswith("validate-draft-")
    assert m.verdict == "pass" and Path(m.report_md).is_file() and m.checkpoint_dir == str(good)


def test_weights_changed_since_training_fail_validation_naming_the_file(good, tiny_llama_verifier, tmp_path):
    """The hash recorded at training is compared before anything runs: zeroed bytes inside model.safetensors (the
    same size, a header that still parses) are a failed verdict naming the file, and vLLM never starts."""
    from eagle3.validate.stage import validate_draft

    damaged = rewrite(good, tmp_path / "damaged")
    recorded = sha256_file(damaged / "model.safetensors")
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[-4096:] = bytes(4096)
    (damaged / "model.safetensors").write_bytes(bytes(data))
    m = validate_draft(ValidateConfig(), _checkpoint_artifact(damaged, tiny_llama_verifier, recorded),
                       tmp_path / "v")
    assert m.verdict == "fail" and m.reasons[0].startswith("[weights_modified]")
    assert str(damaged / "model.safetensors") in m.reasons[0]
    assert m.report()["vllm"] == {"skipped": "the checkpoint's weights are not the ones trained"}


def test_bad_settings_raise_before_any_vllm_start(good, tiny_llama_verifier, tmp_path):
    from eagle3.chat.sources import PromptError
    from eagle3.validate.stage import validate_draft

    with pytest.raises(FileNotFoundError, match="vLLM interpreter not found"):
        validate_draft(ValidateConfig(engine={"vllm_python": str(tmp_path / "no-python")}), good, tmp_path / "a",
                       verifier=tiny_llama_verifier)
    short = tmp_path / "one.jsonl"
    short.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(PromptError, match="holds 1 conversations, 8 prompts"):
        validate_draft(ValidateConfig(engine={"vllm_python": sys.executable}), good, tmp_path / "b", verifier=tiny_llama_verifier,
                       prompts_path=short)


def test_prompt_file_rows_of_the_wrong_shape_are_one_clear_error(tmp_path):
    from eagle3.chat.sources import PromptError, read_prompt_messages

    for i, line in enumerate(["5", '{"messages": ["hi"]}', '{"conversations": {"from": "human"}}']):
        f = tmp_path / f"p{i}.jsonl"
        f.write_text(line + "\n")
        with pytest.raises(PromptError, match=rf"p{i}\.jsonl:1: "):
            read_prompt_messages(f, 1)


def test_missing_verifier_is_reported_as_not_found(good, tmp_path):
    from eagle3.validate.stage import validate_draft

    missing = tmp_path / "no-such-verifier"
    m = validate_draft(ValidateConfig(run_vllm=False, compare_untrained=False, offline_reference=False), good,
                       tmp_path / "v", verifier=missing)
    assert m.verdict == "fail" and any(f"verifier not found: {missing} does not exist" in r for r in m.reasons)


def test_untrained_draft_starts_where_the_trained_run_started(tiny_llama_verifier, tmp_path):
    """compare_untrained's draft is the trainer's step 0: a run with ``init_from_layer`` gets that verifier layer."""
    from helpers import tiny_draft

    from eagle3.support.verifier import read_layer
    from eagle3.validate.stage import make_untrained_draft

    trained = tiny_draft(tiny_llama_verifier, dtype="float32")
    plain = save_draft(tmp_path / "plain", trained.config, trained.state_dict(), {"run_config": {"seed": 0}})
    layered = save_draft(tmp_path / "layered", trained.config, trained.state_dict(),
                         {"run_config": {"seed": 0, "init_from_layer": -1}})
    last = VerifierSpec.from_path(tiny_llama_verifier).num_hidden_layers - 1
    up = read_layer(tiny_llama_verifier, last, ("mlp.up_proj.weight",))["mlp.up_proj.weight"]
    got = {name: load_file(str(make_untrained_draft(folder, tiny_llama_verifier, tmp_path / f"u-{name}")
                               / "model.safetensors"))["midlayer.mlp.up_proj.weight"].float()
           for name, folder in (("plain", plain), ("layered", layered))}
    assert torch.equal(got["layered"], up)
    assert not torch.allclose(got["plain"], up, atol=1e-3)
    # the run's seed: a seed-1 run is compared with the seed-1 init, not seed 0's
    seeded = save_draft(tmp_path / "seeded", trained.config, trained.state_dict(), {"run_config": {"seed": 1}})
    fc = load_file(str(make_untrained_draft(seeded, tiny_llama_verifier, tmp_path / "u-seeded") / "model.safetensors"))
    want = Eagle3Draft.from_verifier(trained.config, tiny_llama_verifier, trained.d2t, trained.t2d, seed=1)
    torch.testing.assert_close(fc["fc.weight"].float(), want.fc.weight.float())
    for broken in ("{not json", '{"run_config": null}', '{"run_config": {"seed": "x"}}'):
        (seeded / "eagle3_run.json").write_text(broken)
        with pytest.raises(ValueError, match=r"eagle3_run.json: unreadable"):
            make_untrained_draft(seeded, tiny_llama_verifier, tmp_path / "u-broken")

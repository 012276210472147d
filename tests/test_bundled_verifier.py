"""The bundled tiny chat verifier (models/tiny-chat-verifier) and its data (data/stdlib-chat): shipped artifacts load
offline, the tokenizer round-trips bytes, the chat template renders, the splits are disjoint, the builder is
deterministic, and the model passes the quality gate (varied greedy text, no single-token loops)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from safetensors import safe_open

from tools import tiny_verifier as bundled
from tools.tiny_verifier import (
    DEFAULT_DATA_DIR,
    DEFAULT_MODEL_DIR,
    build_package_conversations,
    build_short_doc_conversations,
    build_stdlib_conversations,
    greedy_generate,
    longest_run,
    quality_prompts,
    read_messages,
    reasked_conversations,
    top_level,
)

SUBSET = ["colorsys", "getopt", "json", "textwrap"]  # small modules: one in the eval bucket (json), the others not


@pytest.fixture(scope="module")
def tokenizer():
    return bundled.load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def model(bundled_verifier):
    torch.set_num_threads(2)
    return bundled.load_model(bundled_verifier)


@pytest.fixture(scope="module")
def eval_messages():
    return read_messages(DEFAULT_DATA_DIR / "eval.openai.jsonl")


def _sharegpt_modules(split: str) -> set[str]:
    with (DEFAULT_DATA_DIR / f"{split}.sharegpt.jsonl").open(encoding="utf-8") as f:
        return {json.loads(line)["id"].split("/", 1)[0] for line in f}


# --- tokenizer -------------------------------------------------------------------------------------------------


def test_tokenizer_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 8192
    ids = tokenizer.convert_tokens_to_ids(list(bundled.SPECIAL_TOKENS))
    assert ids == list(range(len(bundled.SPECIAL_TOKENS)))
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|end|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.encode("x y", add_special_tokens=False) == tokenizer("x y")["input_ids"]  # no implicit BOS


def test_byte_level_round_trip(tokenizer):
    rng = random.Random(0)
    texts = [
        "Return a list of strings.\r\n\tIndented  double  spaces   ",
        "Unicode: héllo wörld, 中文, русский, العربية, emoji 🤖🎉, combining e\u0301, zero-width \u200b, NUL \x00.",
        "  leading and trailing whitespace \n\n\n",
        "".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(300)).encode("utf-8", "replace").decode("utf-8"),
        "".join(chr(rng.randrange(0, 0x80)) for _ in range(300)),
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_chat_template_renders_system_multi_turn_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does json.dumps do?"},
        {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
        {"role": "user", "content": "And json.loads?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nWhat does json.dumps do?<|end|>\n"
        "<|assistant|>\nSerialize obj to a JSON formatted str.<|end|>\n<|user|>\nAnd json.loads?<|end|>\n<|assistant|>\n"
    )
    assert not tokenizer.apply_chat_template(messages, tokenize=False).endswith("<|assistant|>\n")


def test_assistant_content_tokenizes_cleanly_and_is_masked(tokenizer):
    content = "Return the  value\n of x; see 'help()'."
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": content}]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    alone = tokenizer.encode(content, add_special_tokens=False)
    masked = [t for t, m in zip(ids, mask) if m]
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    assert masked == alone + [end_id]  # the answer's tokens as if tokenized alone, then the end-of-turn token


# --- data ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "eval"])
def test_data_files_parse_in_both_formats_with_equal_conversations(split):
    sharegpt = read_messages(DEFAULT_DATA_DIR / f"{split}.sharegpt.jsonl")
    openai = read_messages(DEFAULT_DATA_DIR / f"{split}.openai.jsonl")
    assert len(sharegpt) == len(openai) > 0
    assert sharegpt == openai
    for messages in openai:
        roles = [m["role"] for m in messages]
        body = roles[1:] if roles[0] == "system" else roles
        assert body == ["user", "assistant"] * (len(body) // 2) and len(body) >= 2
        assert all(len(m["content"]) >= bundled.MIN_DOC_CHARS for m in messages if m["role"] == "assistant")
    assert any(m[0]["role"] == "system" for m in openai) and any(len(m) >= 4 for m in openai)


def test_eval_modules_disjoint_from_train():
    train, held = _sharegpt_modules("train"), _sharegpt_modules("eval")
    assert held and train
    assert not {top_level(m) for m in train} & {top_level(m) for m in held}
    manifest = json.loads((DEFAULT_DATA_DIR / "manifest.json").read_text())
    assert set(manifest["modules"]["eval"]) == held and set(manifest["modules"]["train"]) == train
    assert all(bundled.is_heldout(m) for m in held) and not any(bundled.is_heldout(m) for m in train)
    train_answers = {
        m["content"]
        for c in read_messages(DEFAULT_DATA_DIR / "train.openai.jsonl")
        for m in c
        if m["role"] == "assistant"
    }
    held_answers = {
        m["content"]
        for c in read_messages(DEFAULT_DATA_DIR / "eval.openai.jsonl")
        for m in c
        if m["role"] == "assistant"
    }
    assert not train_answers & held_answers


def test_short_doc_prompts_are_new_training_objects_and_rebuild_exactly():
    """train-short.openai.jsonl: questions about training-module objects the bundled splits do not hold (docstrings
    of 1-79 characters), what the builder writes, counted in the manifest. (Rebuilt for a few modules only: under
    pytest, imported packages patch some stdlib objects, e.g. inspect.Signature.from_callable, and the whole
    build then differs from the file's.)"""
    path = DEFAULT_DATA_DIR / bundled.SHORT_DOCS_FILE
    short = read_messages(path)
    assert len(short) > 1000
    built = build_short_doc_conversations(["argparse", "json.encoder", "textwrap", "zipfile"])
    assert {c.split for c in built} == {"train", "eval"}  # json.* is held out: never written
    train = [c.messages for c in built if c.split == "train"]
    assert train and all(messages in short for messages in train)
    assert not any(messages in short for c in built if c.split == "eval" for messages in [c.messages])
    answers = [m["content"] for c in short for m in c if m["role"] == "assistant"]
    assert all(0 < len(a) < bundled.MIN_DOC_CHARS for a in answers)
    bundled_answers = {m["content"] for split in ("train", "eval")
                       for c in read_messages(DEFAULT_DATA_DIR / f"{split}.openai.jsonl") for m in c}
    assert not set(answers) & bundled_answers
    questions = {m["content"] for c in short for m in c if m["role"] == "user"}
    eval_questions = {m["content"] for c in read_messages(DEFAULT_DATA_DIR / "eval.openai.jsonl") for m in c
                      if m["role"] == "user"}
    assert not questions & eval_questions
    manifest = json.loads((DEFAULT_DATA_DIR / "manifest.json").read_text())
    assert manifest["short_docs"]["conversations"] == len(short)
    assert manifest["sha256"][bundled.SHORT_DOCS_FILE] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_package_prompts_ask_about_a_package_and_never_name_an_avoided_topic(tmp_path, monkeypatch):
    """build_package_conversations (bench/topic_prompts.py's new-topic prompts) on a package written here: its
    public submodules one level down are asked about, private, test and deeper ones are not, a conversation whose
    question names an avoided word is dropped, and a docstring shared by two modules is asked once."""
    doc = "A docstring long enough to be asked about: it explains what the object does in some detail here."
    files = {
        "weatherkit/__init__.py": f'"""Weather forecasts. {doc}"""\n',
        "weatherkit/radar.py": (f'"""Radar images. {doc}"""\n\ndef sweep(angle):\n    """Sweep. {doc}"""\n\n'
                                f'class Dish:\n    """A dish. {doc}"""\n\n'
                                f'    def turn(self):\n        """Turn. {doc}"""\n'),
        "weatherkit/jsonfeed.py": f'"""A feed. {doc}"""\n\ndef pull():\n    """Pull. {doc}"""\n',
        "weatherkit/_private.py": f'"""Private. {doc}"""\n',
        "weatherkit/tests/__init__.py": f'"""Tests. {doc}"""\n',
        "weatherkit/deep/__init__.py": f'"""Deep. {doc}"""\n',
        "weatherkit/deep/deeper.py": f'"""Deeper. {doc}"""\n',
        "weatherkit/zcopy.py": f'"""Radar images. {doc}"""\n',  # the radar module's docstring again
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    built = build_package_conversations(["weatherkit", "no_such_package_here"], avoid=["json"])
    asked = {c.module for c in built}
    # not jsonfeed (avoided), deeper (2 levels down), zcopy (a copy), _private, tests
    assert asked == {"weatherkit", "weatherkit.radar", "weatherkit.deep"}
    objects = sorted(m["content"] for c in built for m in c.messages if m["role"] == "assistant")
    assert len(objects) == 6 == len(set(objects))  # the package, radar, sweep, Dish, Dish.turn, deep
    assert all(c.split == "train" for c in built)
    questions = " ".join(m["content"] for c in built for m in c.messages if m["role"] == "user")
    assert "weatherkit.radar" in questions and "json" not in questions.lower()
    assert {c.module for c in build_package_conversations(["weatherkit"], avoid=["JSON"])} == asked  # any case
    assert {c.module for c in build_package_conversations(["weatherkit"])} == asked | {"weatherkit.jsonfeed"}


def test_reasked_prompts_ask_about_the_same_objects_in_other_words():
    """reasked_conversations (bench/topic_prompts.py's re-asked prompts): the same objects in the same order and
    the same number of turns, each question in another wording; a chat whose answer is no stdlib docstring is left
    out; the same seed gives the same prompts."""
    rows = [c.messages for c in build_stdlib_conversations(SUBSET) if c.split == "train"]
    odd = [{"role": "user", "content": "What is colorsys?"}, {"role": "assistant", "content": "Not a docstring."}]
    again = reasked_conversations([*rows, odd], seed=1, modules=SUBSET)
    assert len(again) == len(rows) > 5
    for old, new in zip(rows, again):
        answers = [m["content"] for m in old if m["role"] == "assistant"]
        assert [m["content"] for m in new.messages if m["role"] == "assistant"] == answers
        asks = [m["content"] for m in old if m["role"] == "user"]
        new_asks = [m["content"] for m in new.messages if m["role"] == "user"]
        assert len(new_asks) == len(asks) and new_asks[0] != asks[0]
        assert new.split == "train" and new.module == new.id.split("/")[0]
    assert [c.messages for c in reasked_conversations(rows, seed=1, modules=SUBSET)] == [c.messages for c in again]
    assert [c.messages for c in reasked_conversations(rows, seed=2, modules=SUBSET)] != [c.messages for c in again]


def test_builder_is_deterministic_across_processes_and_hash_seeds():
    def dump(convs):
        return json.dumps([[c.id, c.module, c.split, c.messages] for c in convs])

    here = dump(build_stdlib_conversations(SUBSET))
    assert here == dump(build_stdlib_conversations(list(reversed(SUBSET))))
    code = (
        "import json, sys; from tools.tiny_verifier import build_stdlib_conversations as b; "
        "print(json.dumps([[c.id, c.module, c.split, c.messages] for c in b(sys.argv[1:])]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run(
        [sys.executable, "-c", code, *SUBSET],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert here == other
    convs = json.loads(here)
    assert {c[1] for c in convs} == set(SUBSET) and {c[2] for c in convs} == {"train", "eval"}


# --- model -----------------------------------------------------------------------------------------------------


def test_shipped_model_files(bundled_verifier):
    config = json.loads((bundled_verifier / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 8192 and config["hidden_size"] == 256 and config["num_hidden_layers"] == 4
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    generation = json.loads((bundled_verifier / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {1, 6} and generation["pad_token_id"] == 2
    with safe_open(str(bundled_verifier / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
        assert f.get_slice("lm_head.weight").get_shape() == [8192, 256]
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    assert (bundled_verifier / "model.safetensors").stat().st_size < 20 * 2**20
    assert "perplexity" in (bundled_verifier / "README.md").read_text()


def test_quality_gate_varied_greedy_answers_on_heldout_prompts(model, tokenizer, eval_messages):
    prompts = quality_prompts(eval_messages, n=5)
    assert len(prompts) == 5
    for prompt in prompts:
        new_ids = greedy_generate(model, tokenizer, prompt, max_new_tokens=64, ignore_eos=True)
        text = tokenizer.decode(new_ids)
        assert len(set(new_ids)) >= 20, f"{prompt[-1]['content']!r} -> {text!r}"
        assert longest_run(new_ids) < 8, f"{prompt[-1]['content']!r} -> {text!r}"

"""Build the two chat-template tokenizer fixtures under tests/data/ (run once; the outputs are committed).

Both are byte-level BPE tokenizers (vocab 1024) trained on standard-library docstrings, the only real English
text every Python machine has, saved as real tokenizer folders with two real template shapes:

* ``tok-chatml-generation/``: a ChatML (Qwen-style) template that injects a default system prompt and marks each
  assistant turn with ``{% generation %}`` (content + ``<|im_end|>``), as TRL-ready templates do.
* ``tok-llama3/``: Meta-Llama-3-8B-Instruct's header template verbatim (``bos_token``, ``| trim`` on contents,
  ``<|eot_id|>`` ends every turn), which has no generation block.

    .venv/bin/python tests/data/make_tokenizers.py
"""

from __future__ import annotations

import inspect
import pkgutil
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHATML_GENERATION_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Meta-Llama-3-8B-Instruct's chat_template, unchanged.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def stdlib_docstrings(limit_chars: int = 400_000) -> list[str]:
    import importlib

    texts, total = [], 0
    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.endswith("python3.11")
                   and not m.name.startswith(("_", "test", "idlelib", "tkinter", "turtle", "antigravity", "this")))
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - any stdlib module that fails to import here is just left out
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
        for _, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if doc and len(doc) > 80:
                texts.append(doc)
                total += len(doc)
        if total >= limit_chars:
            break
    return texts


def build(out: Path, special: list[str], template: str, bos: str | None, eos: str, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    fast.chat_template = template
    fast.save_pretrained(out)


def main() -> None:
    texts = stdlib_docstrings()
    print(f"training on {len(texts)} docstrings, {sum(map(len, texts)):,} chars", file=sys.stderr)
    build(HERE / "tok-chatml-generation", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
          CHATML_GENERATION_TEMPLATE, None, "<|im_end|>", texts)
    build(HERE / "tok-llama3", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                "<|end_header_id|>", "<|eot_id|>"],
          LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", texts)


if __name__ == "__main__":
    main()

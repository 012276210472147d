"""The one chat encoder: a tokenizer + chat template render conversations, find the assistant loss mask and tokenize
them (prepare), and render the generation prompt of a conversation (regeneration, validation), so a template
override (``ChatSettings.chat_template``) reaches every stage that renders a conversation.

Imports the standard library, jinja2 and transformers only (the regeneration driver runs it in the vLLM
environment).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, Field

from eagle3.chat.errors import BadRow, DataError
from eagle3.support.settings import RUNTIME, SETTINGS_MODEL


class ChatSettings(BaseModel):
    """What renders conversations into verifier tokens: set once (the pipeline's data section) and used by prepare,
    regeneration and validation alike."""

    model_config = SETTINGS_MODEL

    tokenizer_path: str = Field(
        description="Verifier (or its tokenizer) folder: its tokenizer and chat template render the conversations.",
        json_schema_extra=RUNTIME)  # keyed by content: describe_tokenizer
    chat_template: str | None = Field(
        None, description="Chat template overriding the tokenizer's own: Jinja text, a path to a template file, or the "
        "name of one of the tokenizer's named templates.")
    trust_remote_code: bool = Field(
        False, description="Allow the tokenizer's own Python code (needed by e.g. Kimi's tiktoken tokenizer).")
    mask_method: Literal["auto", "generation", "prefix"] = Field(
        "auto", description="How assistant tokens are located: 'generation' (the template's {% generation %} blocks), "
        "'prefix' (prefix renderings), 'auto' (generation blocks when the template has them).")

    def chat_settings(self) -> ChatSettings:
        """These settings alone (a subclass such as PrepareConfig carries more fields): what the regeneration
        driver and validation receive, so all three render with the same values."""
        return ChatSettings.model_validate(self.model_dump(include=set(ChatSettings.model_fields)))

    def held_out_prompt_ids(self, prompts_path: str | os.PathLike, num_prompts: int) -> list[list[int]]:
        """The held-out prompts (the first user turn, after its system message, of each of the first
        ``num_prompts`` conversations of ``prompts_path``) rendered with the generation prompt: the token ids
        validation sends to vLLM and the offline reference, and regeneration's baseline request, so all measure the
        prompt format training saw."""
        from eagle3.chat.sources import read_prompt_messages

        return self.encoder().prompt_ids(read_prompt_messages(prompts_path, num_prompts))

    def encoder(self) -> ChatEncoder:
        """The encoder of these settings (loads the tokenizer)."""
        tokenizer, template = load_chat_tokenizer(self.tokenizer_path, self.chat_template, self.trust_remote_code)
        return ChatEncoder(tokenizer, template, self.mask_method, name=repr(self.tokenizer_path))


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]


def load_chat_tokenizer(tokenizer_path: str, chat_template: str | None = None, trust_remote_code: bool = False):
    """Load the verifier's tokenizer; return ``(tokenizer, template_text)``; DataError without a template."""
    from transformers import AutoTokenizer

    local = Path(tokenizer_path)
    if (local.is_absolute() or tokenizer_path.startswith(".") or len(local.parts) > 2) and not local.exists():
        # a folder path (a hub id is "org/name"): say so, not the hub's "repo id must be in the form ..." error
        raise DataError(f"tokenizer not found: {tokenizer_path} does not exist (tokenizer_path: a tokenizer folder, "
                        f"by default the verifier's, verifier_path)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer_path {tokenizer_path!r}: cannot load a tokenizer ({e})") from e
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if chat_template is not None and "{" not in chat_template and chat_template not in named:
        # no Jinja in it: a file path (a template always has {{ or {%), or a typo that must not render as text
        if not Path(chat_template).is_file():
            raise DataError(f"chat_template {chat_template!r}: no such file (nor a template of {tokenizer_path!r})")
        chat_template = Path(chat_template).read_text(encoding="utf-8")
    try:
        template = tokenizer.get_chat_template(chat_template)
    except ValueError as e:
        raise DataError(
            f"tokenizer at {tokenizer_path!r} has no chat template: set PrepareConfig.chat_template ({e})"
        ) from e
    return tokenizer, template


class ChatEncoder:
    """Renders conversations with one tokenizer + template and tokenises them with the assistant mask."""

    def __init__(self, tokenizer: Any, chat_template: str, mask_method: str = "auto", name: str = ""):
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render_jinja = render_jinja_template
        self.tokenizer, self.template, self.name = tokenizer, chat_template, name or "tokenizer"
        self.template_sha256 = hashlib.sha256(chat_template.encode("utf-8")).hexdigest()
        has_generation = re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None
        if mask_method == "generation" and not has_generation:
            raise DataError(f"mask_method='generation' but the chat template of {self.name} has no {{% generation %}}")
        self.method = "generation" if (mask_method == "generation" or (mask_method == "auto" and has_generation)) \
            else "prefix"
        # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template: so do we
        self._template_kwargs = dict(tokenizer.special_tokens_map)
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        specials = sorted({t.content for t in added if t.special}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        fast = getattr(tokenizer, "is_fast", False) and hasattr(tokenizer.backend_tokenizer, "encode_batch_fast")
        self._backend = tokenizer.backend_tokenizer if fast else None
        self._check_concatenation()

    def _check_concatenation(self) -> None:
        pieces = ["Hello", " world", "\n\nnew line", " and  spaces"]
        ids = [i for p in self._tokenize(pieces) for i in p]
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text != "".join(pieces):
            raise DataError(
                f"tokenizer {self.name}: tokenising text in pieces does not concatenate ({text!r} != "
                f"{''.join(pieces)!r}); it adds something to every call (SentencePiece leading space?), "
                "which the exact assistant mask cannot be built with"
            )

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:  # the Rust tokenizer itself: what tokenizer(texts) calls, minus offsets
            return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._render_jinja([messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
                                  **self._template_kwargs)[0][0]

    def prompt_ids(self, conversations: list[list[dict]]) -> list[list[int]]:
        """Token ids of each conversation rendered with the generation prompt: what the verifier reads before it
        answers (regeneration's prompts, validation's prompts). Raises BadRow for a conversation the template
        refuses."""
        texts = []
        for messages in conversations:
            try:
                texts.append(self.render(messages, add_generation_prompt=True))
            except (TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
                raise BadRow("template_error", f"{type(e).__name__}: {e}") from None
        return [list(map(int, ids)) for ids in self._tokenize(texts)] if texts else []

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """Rendered conversation and the ``[start, end)`` character spans to mask; raises BadRow."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            if self.method == "generation":
                (text,), (spans,) = self._render_jinja([messages], chat_template=self.template,
                                                       return_assistant_tokens_mask=True, **self._template_kwargs)
                spans = [tuple(s) for s in spans if s[1] > s[0]]
                if len(spans) != len(assistant) or not all(
                    messages[i]["content"].strip() in text[a:b] for i, (a, b) in zip(assistant, spans)
                ):
                    raise BadRow("content_not_rendered", "generation blocks do not hold the assistant messages")
                return text, spans
            text = self.render(messages)
            spans = []
            for i in assistant:
                before = self.render(messages[:i], add_generation_prompt=True)
                through = text if i == len(messages) - 1 else self.render(messages[: i + 1])
                if not (through.startswith(before) and text.startswith(through)):
                    raise BadRow("not_prefix_stable", f"message {i}")
                spans.append(self._turn_span(text, len(before), len(through), messages[i]["content"], i))
            return text, spans
        except BadRow:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            # raise_exception() in the template, or e.g. `'+'` on a value the template did not expect
            raise BadRow("template_error", f"{type(e).__name__}: {e}") from None

    def _turn_span(self, text: str, start: int, end: int, content: str, i: int) -> tuple[int, int]:
        turn = text[start:end]  # what the template writes for assistant message i after the generation prompt
        at, length = turn.find(content), len(content)
        if at < 0:  # templates that `| trim` the content
            at, length = turn.find(content.strip()), len(content.strip())
        if at < 0:
            raise BadRow("content_not_rendered", f"message {i}")
        stop = start + at + length
        if self._special_re is not None:
            m = self._special_re.search(text, stop, end)
            if m and not text[stop:m.start()].strip():
                stop = m.end()  # the end-of-turn token the verifier generates
        return start + at, stop

    def encode(self, conversations: list[list[dict]]) -> list[Encoded | BadRow]:
        """Render + tokenise a batch; one tokenizer call for all pieces of all conversations."""
        pieces: list[str] = []
        layout: list[list[tuple[int, int]] | BadRow] = []  # per conversation: (piece index, mask flag) list
        for messages in conversations:
            try:
                text, spans = self.assistant_spans(messages)
            except BadRow as bad:
                layout.append(bad)
                continue
            entry, pos = [], 0
            for a, b in _merge(spans):
                for s, e, flag in ((pos, a, 0), (a, b, 1)):
                    if e > s:
                        entry.append((len(pieces), flag))
                        pieces.append(text[s:e])
                pos = b
            if len(text) > pos:
                entry.append((len(pieces), 0))
                pieces.append(text[pos:])
            layout.append(entry)
        ids = self._tokenize(pieces) if pieces else []
        out: list[Encoded | BadRow] = []
        for entry in layout:
            if isinstance(entry, BadRow):
                out.append(entry)
                continue
            input_ids: list[int] = []
            mask: list[int] = []
            for k, flag in entry:
                input_ids.extend(ids[k])
                mask.extend([flag] * len(ids[k]))
            out.append(Encoded(input_ids, mask))
        return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def describe_tokenizer(chat: ChatSettings):
    """The identity of what renders and tokenizes the conversations: the tokenizer folder's tokenizer and template
    files, and a chat_template override (its text, or the content of the file it names)."""
    from eagle3.chat.sources import DataSources
    from eagle3.support.io import sha256_json
    from eagle3.support.verifier import tokenizer_fingerprint

    template = chat.chat_template
    if template is not None and "{" not in template and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    return DataSources(sources=[chat.tokenizer_path], fingerprint=sha256_json([
        tokenizer_fingerprint(chat.tokenizer_path) if Path(chat.tokenizer_path).is_dir() else chat.tokenizer_path,
        template]))

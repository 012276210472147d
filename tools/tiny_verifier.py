"""The bundled tiny chat verifier: data, tokenizer and model that tests and the demo use in place of a big LLM.

Where it sits: outside the pipeline proper. Every stage of the pipeline needs a *verifier* (the target LLM whose
hidden states the EAGLE-3 draft learns from); on a 2-core CPU machine with no model hub, this module builds one
from text every Python install carries, the docstrings of the standard library:

    build_stdlib_conversations()  ->  Conversation list (train / eval split by held-out top-level modules)
    write_sharegpt / write_openai ->  data/stdlib-chat/{train,eval}.{sharegpt,openai}.jsonl
    build_short_doc_conversations() -> data/stdlib-chat/train-short.openai.jsonl: the objects whose docstrings are
                                     too short to teach the tiny verifier, as prompts for a verifier that writes
                                     its own answers (regeneration); never used to train the tiny verifier
    build_package_conversations() -> the same questions about installed third-party packages (new topics, for
                                     regeneration; bench/topic_prompts.py); never bundled
    train_tokenizer()             ->  byte-level BPE, vocab 8192, role tokens, Jinja chat template
    train_tiny_llama()            ->  LlamaForCausalLM (4 layers, hidden 256, untied lm_head), saved in bf16
    write_model_card()            ->  README.md beside the weights

`tools/build_tiny_verifier.py` runs all of it; nothing here imports Prefect.

The split is by TOP-LEVEL module (``email.utils`` goes wherever ``email`` goes), chosen by a hash of the name, so
no docstring of an evaluation module, nor of its sibling submodules, is ever seen in training. Docstrings are
de-duplicated by text across the whole build, so a re-exported object (``posixpath.join`` / ``os.path.join``)
cannot leak from one split into the other either.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import pkgutil
import random
import re
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.chat import formats as chat
from eagle3.support.paths import BUNDLED_DATA, BUNDLED_VERIFIER
from eagle3.support.provenance import git_revision as current_revision
from eagle3.support.provenance import versions
from eagle3.train.schedule import lr_at

if TYPE_CHECKING:
    import torch

DEFAULT_DATA_DIR = BUNDLED_DATA
DEFAULT_MODEL_DIR = BUNDLED_VERIFIER

# ---------------------------------------------------------------------------------------------------------------
# Conversations from standard-library docstrings
# ---------------------------------------------------------------------------------------------------------------

# Top-level modules never used: GUI/demo code, test suites, import-time side effects (antigravity opens a browser,
# `this` prints), packaging helpers whose docstrings are internal notes, and modules removed in 3.12+ that would
# make the data depend on the Python version more than it has to.
EXCLUDED_TOP_LEVEL = frozenset(
    {
        "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "pydoc_data",
        "ensurepip", "distutils", "msilib", "winreg", "winsound", "nt", "asynchat", "asyncore", "smtpd", "imp",
    }
)  # fmt: skip
MIN_DOC_CHARS = 80
SHORT_DOCS_FILE = "train-short.openai.jsonl"  # conversations about the objects with docstrings under MIN_DOC_CHARS
MAX_DOC_CHARS = 2000  # longer docstrings are cut at a paragraph boundary (a handful of class docstrings run to 10 KB)
HOLDOUT_PERCENT = 8  # share of top-level modules (by hash bucket) held out for evaluation

SYSTEM_PROMPTS = (
    "You are a helpful assistant that answers questions about the Python standard library.",
    "You are a Python documentation assistant. Answer with the official documentation of the object asked about.",
    "You are an expert Python programmer. Explain standard library APIs accurately.",
    "Answer questions about Python's standard library using its docstrings.",
    "You are a concise assistant for Python developers.",
    "You help people read Python code by explaining the library functions and classes it uses.",
)

# {qual} = module.name, {name} = the object's name, {module} = its module.
FUNCTION_QUESTIONS = (
    "What does {qual} do?",
    "Can you explain the {name} function from the {module} module?",
    "How do I use {qual}?",
    "What is {qual} for?",
    "Show me the documentation of {qual}.",
    "I'm reading some Python code that calls {qual}. What does it do?",
    "Explain {name} in {module}.",
    "What is the purpose of {module}.{name}()?",
    "Could you describe what {name} in the {module} module does?",
    "Tell me about {qual}.",
    "help({qual})",
    "In Python's {module} module, what does {name} do?",
)
CLASS_QUESTIONS = (
    "What is {qual}?",
    "Can you explain the {name} class from the {module} module?",
    "How do I use the {qual} class?",
    "What is {qual} used for?",
    "Show me the documentation of the {name} class in {module}.",
    "I found {qual} in some code. What is it?",
    "Explain the {module}.{name} class.",
    "Tell me about the {name} class.",
    "Describe {qual}.",
    "help({qual})",
    "What does the {name} class in the {module} module represent?",
)
METHOD_QUESTIONS = (
    "What does {qual} do?",
    "What does the {method} method of {owner} do?",
    "How do I call {qual}()?",
    "Explain {owner}.{method}.",
    "Show me the documentation of {qual}.",
    "help({qual})",
    "What is {method} on a {owner} object for?",
)
MODULE_QUESTIONS = (
    "What is the {module} module?",
    "What is the {module} module for?",
    "Give me an overview of {module}.",
    "What does Python's {module} module provide?",
    "help({module})",
    "Tell me about the {module} module.",
)
EXCEPTION_QUESTIONS = (
    "What is the {name} exception in {module}?",
    "When is {qual} raised?",
    "What does {qual} mean?",
    "Tell me about the {qual} exception.",
    "help({qual})",
)
FOLLOW_UPS = (
    "And what about {name}?",
    "Thanks. How about {qual}?",
    "Also in {module}: what is {name}?",
    "One more: explain {name}.",
    "What about {qual}?",
    "OK. And {name}?",
    "Great, and what does {name} do?",
)
# Share of conversations with 1, 2 and 3 user turns.
TURN_WEIGHTS = ((1, 0.70), (2, 0.22), (3, 0.08))
SYSTEM_PROMPT_SHARE = 0.30


@dataclass(frozen=True)
class DocEntry:
    """One public function or class of one module and its cleaned docstring."""

    module: str
    name: str
    kind: str  # "module" | "function" | "class" | "exception" | "method"
    doc: str

    @property
    def qualname(self) -> str:
        return self.module if self.kind == "module" else f"{self.module}.{self.name}"


@dataclass
class Conversation:
    """One chat: `messages` in OpenAI roles ("system" | "user" | "assistant"), ending with an assistant turn."""

    id: str  # "<module>/<first object name>"
    module: str
    split: str  # "train" | "eval"
    messages: list[dict[str, str]] = field(default_factory=list)


def top_level(module: str) -> str:
    return module.split(".", 1)[0]


def is_heldout(module: str, percent: int = HOLDOUT_PERCENT) -> bool:
    """True for modules whose TOP-LEVEL name hashes into the evaluation bucket (stable across processes)."""
    digest = hashlib.sha256(top_level(module).encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def _excluded_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in EXCLUDED_TOP_LEVEL or any(p.startswith("_") for p in parts):
        return True
    if any(p in ("test", "tests") or p.startswith("test_") for p in parts):
        return True
    if any(p.startswith("windows_") or p.endswith("_win32") for p in parts):
        return True
    return parts[0] == "encodings" and len(parts) > 1  # ~120 codec modules with one boilerplate docstring each


@contextlib.contextmanager
def _quiet_imports():
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        yield


def _try_import(name: str):
    with _quiet_imports():
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - platform-specific modules raise ImportError, OSError, even SystemExit
            return None


def stdlib_module_names() -> list[str]:
    """Sorted public, importable standard-library modules and submodules (tests, GUI and private ones excluded)."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        if _excluded_module(top):
            continue
        mod = _try_import(top)
        if mod is None:
            continue
        names.add(top)
        if hasattr(mod, "__path__"):
            for info in pkgutil.walk_packages(mod.__path__, top + ".", onerror=lambda _name: None):
                if not _excluded_module(info.name) and _try_import(info.name) is not None:
                    names.add(info.name)
    return sorted(names)


def clean_doc(doc: str, max_chars: int = MAX_DOC_CHARS) -> str:
    """`inspect.cleandoc`, trailing spaces stripped, blank runs collapsed, cut at a paragraph boundary."""
    text = inspect.cleandoc(doc)
    text = "\n".join(line.rstrip() for line in text.splitlines())
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    if len(text) > max_chars:
        cut = text.rfind("\n\n", 0, max_chars)
        text = text[: cut if cut >= MIN_DOC_CHARS else max_chars].rstrip()
    return text


def _owned_by(obj, module: str) -> bool:
    """Objects a module defines, including its C accelerator's (`functools.reduce.__module__ == "_functools"`)."""
    owner = getattr(obj, "__module__", None)
    return isinstance(owner, str) and (owner == module or owner.lstrip("_") == module)


def _doc_of(obj) -> str | None:
    """The object's own docstring (a class's `__doc__` is not inherited; staticmethod/classmethod unwrapped)."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    raw = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return raw if isinstance(raw, str) else None


def _is_method(obj) -> bool:
    return inspect.isfunction(obj) or inspect.ismethoddescriptor(obj) or isinstance(obj, (classmethod, staticmethod))


def module_doc_entries(module: str, short: bool = False) -> list[DocEntry]:
    """The module's own docstring, its public functions and classes, and the public methods each class defines
    itself (not inherited), with a docstring of at least MIN_DOC_CHARS characters (``short``: of 1 to
    MIN_DOC_CHARS - 1 characters instead); in a fixed order."""
    mod = _try_import(module)
    if mod is None:
        return []
    exported = getattr(mod, "__all__", None)
    use_all = isinstance(exported, (list, tuple)) and all(isinstance(n, str) for n in exported)
    names = sorted(set(exported)) if use_all else sorted(n for n in vars(mod) if not n.startswith("_"))
    candidates: list[tuple[str, str, object]] = [("module", "", mod)]
    for name in names:
        if name.startswith("_"):
            continue
        obj = getattr(mod, name, None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if not use_all and not _owned_by(obj, module):
            continue  # imported from elsewhere (`from os import path`, `import re` names, ...)
        if not inspect.isclass(obj):
            candidates.append(("function", name, obj))
            continue
        candidates.append(("exception" if issubclass(obj, BaseException) else "class", name, obj))
        for attr, member in sorted(vars(obj).items()):
            if not attr.startswith("_") and _is_method(member):
                candidates.append(("method", f"{name}.{attr}", member))
    entries = []
    for kind, name, obj in candidates:
        raw = _doc_of(obj)
        if raw is None:
            continue
        doc = clean_doc(raw)
        if (0 < len(doc) < MIN_DOC_CHARS) if short else len(doc) >= MIN_DOC_CHARS:
            entries.append(DocEntry(module=module, name=name, kind=kind, doc=doc))
    return entries


def _fill(template: str, entry: DocEntry) -> str:
    owner, _, method = entry.name.rpartition(".")
    return template.format(qual=entry.qualname, name=entry.name, module=entry.module, owner=owner, method=method)


def _question(entry: DocEntry, rng: random.Random) -> str:
    pool = {
        "module": MODULE_QUESTIONS,
        "function": FUNCTION_QUESTIONS,
        "class": CLASS_QUESTIONS,
        "exception": EXCEPTION_QUESTIONS,
        "method": METHOD_QUESTIONS,
    }[entry.kind]
    return _fill(rng.choice(pool), entry)


def _follow_up(entry: DocEntry, rng: random.Random) -> str:
    if entry.kind == "module":
        return _fill("And what is the {module} module itself for?", entry)
    return _fill(rng.choice(FOLLOW_UPS), entry)


def module_conversations(module: str, entries: Sequence[DocEntry], seed: int = 0) -> list[Conversation]:
    """Group one module's entries into 1-3 turn conversations; each docstring is answered exactly once.

    The RNG is seeded by (seed, module) alone, so a module's conversations do not depend on which other modules
    are built alongside it.
    """
    rng = random.Random(f"{seed}:{module}")
    order = list(entries)
    rng.shuffle(order)
    turn_counts, weights = zip(*TURN_WEIGHTS)
    split = "eval" if is_heldout(module) else "train"
    conversations, i = [], 0
    while i < len(order):
        n_turns = rng.choices(turn_counts, weights)[0]
        group, i = order[i : i + n_turns], i + n_turns
        messages: list[dict[str, str]] = []
        if rng.random() < SYSTEM_PROMPT_SHARE:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for turn, entry in enumerate(group):
            ask = _question(entry, rng) if turn == 0 else _follow_up(entry, rng)
            messages.append({"role": "user", "content": ask})
            messages.append({"role": "assistant", "content": entry.doc})
        conv_id = f"{module}/{group[0].name or '__doc__'}"
        conversations.append(Conversation(id=conv_id, module=module, split=split, messages=messages))
    return conversations


def build_stdlib_conversations(modules: Iterable[str] | None = None, seed: int = 0) -> list[Conversation]:
    """Conversations from the docstrings of `modules` (default: the whole standard library), sorted by module.

    Docstrings are de-duplicated by text in sorted module order (the first module that exports an object keeps it).
    Returns train and eval conversations together; `Conversation.split` tells them apart.
    """
    names = sorted(set(modules)) if modules is not None else stdlib_module_names()
    seen: set[str] = set()
    conversations: list[Conversation] = []
    for module in names:
        entries = []
        for entry in module_doc_entries(module):
            if entry.doc not in seen:
                seen.add(entry.doc)
                entries.append(entry)
        conversations.extend(module_conversations(module, entries, seed=seed))
    return conversations


def build_short_doc_conversations(modules: Iterable[str] | None = None, seed: int = 0) -> list[Conversation]:
    """Conversations about the public objects whose docstrings are shorter than MIN_DOC_CHARS (2,570 objects of the
    training modules on Python 3.11; none of them is in build_stdlib_conversations), grouped and asked exactly as
    there, the short docstring as the answer.

    A one-line docstring teaches the tiny verifier little, but the question is a new prompt about a new object: for
    a verifier that writes its own answers (``regenerate.enabled``) these double the bundled training prompts. The
    split is the same hash of the top-level module, so nothing here is about an evaluation module; only the train
    split is written (SHORT_DOCS_FILE). De-duplicated by (name, docstring) in sorted module order: a re-export
    keeps one place, while two enum classes that share "An enumeration." stay two questions.
    """
    names = sorted(set(modules)) if modules is not None else stdlib_module_names()
    seen: set[tuple[str, str]] = set()
    conversations: list[Conversation] = []
    for module in names:
        entries = []
        for entry in module_doc_entries(module, short=True):
            if (entry.name, entry.doc) not in seen:
                seen.add((entry.name, entry.doc))
                entries.append(entry)
        conversations.extend(module_conversations(module, entries, seed=seed))
    return conversations


def package_module_names(package: str, depth: int = 1) -> list[str]:
    """``package`` and its public, importable submodules at most ``depth`` dots below it, sorted ([] when the
    package does not import). Private, test and platform modules are left out by the standard library's rules."""
    mod = _try_import(package)
    if mod is None or _excluded_module(package):
        return []
    names = {package}
    if depth > 0 and hasattr(mod, "__path__"):
        for info in pkgutil.iter_modules(mod.__path__, package + "."):
            if not _excluded_module(info.name) and _try_import(info.name) is not None:
                names.update(package_module_names(info.name, depth - 1))
    return sorted(names)


def build_package_conversations(packages: Sequence[str], avoid: Iterable[str] = (), depth: int = 1,
                                seed: int = 0) -> list[Conversation]:
    """Conversations about installed packages other than the standard library (``packages``: import names), asked
    exactly as build_stdlib_conversations asks, one package after another in the given order: new *topics* in the
    stdlib chats' genre, as prompts for a verifier that writes its own answers (regeneration; the docstring answers
    are placeholders there). A conversation whose user turns contain a string of ``avoid`` anywhere, in any case
    (the evaluation split's top-level modules: "json" drops "orjson.dumps" and "jsonfeed" too), is dropped, so no
    prompt asks about an evaluation topic. De-duplicated by docstring text in package order. ``split`` is "train"
    on every one.

    What a package holds depends on its installed version: record the versions beside anything built from this.
    """
    avoid = [a.lower() for a in avoid]
    seen: set[str] = set()
    conversations: list[Conversation] = []
    for package in packages:
        for module in package_module_names(package, depth):
            entries = []
            for entry in module_doc_entries(module):
                if entry.doc not in seen:
                    seen.add(entry.doc)
                    entries.append(entry)
            for conv in module_conversations(module, entries, seed=seed):
                asks = " ".join(m["content"] for m in conv.messages if m["role"] == "user").lower()
                if not any(a in asks for a in avoid):
                    conv.split = "train"
                    conversations.append(conv)
    return conversations


def reasked_conversations(rows: Sequence[list[dict[str, str]]], seed: int = 1,
                          modules: Iterable[str] | None = None) -> list[Conversation]:
    """The same conversations asked in other words: for each chat of ``rows`` (OpenAI messages of the stdlib chats,
    as bundled), a chat about the same objects in the same order, each user turn drawn again from the question
    templates (never the original wording where the pool has another), the system prompt drawn again. Objects are
    found by their docstring (the bundled answer); a chat with an answer that is not a docstring of this Python's
    standard library (of ``modules``, default all of it) is left out: docstrings change between Python versions,
    so run it on the Python that built the bundled files (3.11) to find every object. For a verifier that writes
    its own answers: new prompts on covered objects only.
    """
    by_doc: dict[str, DocEntry] = {}
    for module in sorted(set(modules)) if modules is not None else stdlib_module_names():
        for entry in module_doc_entries(module):
            by_doc.setdefault(entry.doc, entry)
    rng = random.Random(f"reask:{seed}")
    out: list[Conversation] = []
    for messages in rows:
        asks = [m["content"] for m in messages if m["role"] == "user"]
        entries = [by_doc.get(m["content"]) for m in messages if m["role"] == "assistant"]
        if not entries or any(e is None for e in entries):
            continue
        new: list[dict[str, str]] = []
        if rng.random() < SYSTEM_PROMPT_SHARE:
            new.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for turn, (entry, old) in enumerate(zip(entries, asks)):
            ask = old
            for _ in range(20):  # another template where the pool has one
                ask = _question(entry, rng) if turn == 0 else _follow_up(entry, rng)
                if ask != old:
                    break
            new.append({"role": "user", "content": ask})
            new.append({"role": "assistant", "content": entry.doc})
        out.append(Conversation(id=f"{entries[0].module}/{entries[0].name or '__doc__'}", module=entries[0].module,
                                split="train", messages=new))
    return out


def split_conversations(conversations: Sequence[Conversation]) -> dict[str, list[Conversation]]:
    return {
        "train": [c for c in conversations if c.split == "train"],
        "eval": [c for c in conversations if c.split == "eval"],
    }


# ---------------------------------------------------------------------------------------------------------------
# ShareGPT / OpenAI jsonl
# ---------------------------------------------------------------------------------------------------------------

def to_sharegpt(conv: Conversation) -> dict:
    return chat.to_sharegpt(conv.messages, id=conv.id)


def to_openai(conv: Conversation) -> dict:
    return chat.to_openai(conv.messages)


def _write_jsonl(path: Path, records: Iterable[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def write_sharegpt(path: Path, conversations: Sequence[Conversation]) -> int:
    """`{"id": ..., "conversations": [{"from": "system"|"human"|"gpt", "value": ...}]}` per line."""
    return _write_jsonl(Path(path), (to_sharegpt(c) for c in conversations))


def write_openai(path: Path, conversations: Sequence[Conversation]) -> int:
    """`{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}` per line."""
    return _write_jsonl(Path(path), (to_openai(c) for c in conversations))


def read_messages(path: Path) -> list[list[dict[str, str]]]:
    """Messages (OpenAI roles) of every conversation in a ShareGPT or OpenAI jsonl file."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            record = json.loads(line)
            fmt = chat.detect_format(record)
            if fmt is None:
                raise ValueError(f"{path}:{line_no}: neither 'messages' nor 'conversations'")
            key, role_key, text_key = chat.FORMATS[fmt]
            out.append([{"role": chat.canonical_role(t[role_key]), "content": t[text_key]} for t in record[key]])
    return out


def _counts(convs: Sequence[Conversation]) -> dict:
    return {
        "conversations": len(convs),
        "assistant_turns": sum(m["role"] == "assistant" for c in convs for m in c.messages),
        "modules": len({c.module for c in convs}),
        "chars": sum(len(m["content"]) for c in convs for m in c.messages),
    }


def write_dataset(data_dir: Path, conversations: Sequence[Conversation],
                  short_docs: Sequence[Conversation] = ()) -> dict:
    """Write both splits in both formats, the train split of ``short_docs`` (build_short_doc_conversations) to
    SHORT_DOCS_FILE, and manifest.json; return the manifest."""
    data_dir = Path(data_dir)
    splits = split_conversations(conversations)
    files = {}
    for split, convs in splits.items():
        for fmt, writer in (("sharegpt", write_sharegpt), ("openai", write_openai)):
            path = data_dir / f"{split}.{fmt}.jsonl"
            writer(path, convs)
            files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    short_train = split_conversations(short_docs)["train"]
    if short_train:
        write_openai(data_dir / SHORT_DOCS_FILE, short_train)
        files[SHORT_DOCS_FILE] = hashlib.sha256((data_dir / SHORT_DOCS_FILE).read_bytes()).hexdigest()
    manifest = {
        "source": "Python standard library docstrings",
        "python": sys.version.split()[0],
        "holdout": f"top-level modules with sha256(name) % 100 < {HOLDOUT_PERCENT}",
        "counts": {split: _counts(convs) for split, convs in splits.items()},
        "eval_top_level_modules": sorted({top_level(c.module) for c in splits["eval"]}),
        "modules": {split: sorted({c.module for c in convs}) for split, convs in splits.items()},
        "sha256": files,
    }
    if short_train:
        manifest["short_docs"] = {
            "file": SHORT_DOCS_FILE,
            "what": f"train-split objects whose docstrings are 1 to {MIN_DOC_CHARS - 1} characters: prompts for "
                    "regeneration, not used to train the tiny verifier",
            **_counts(short_train),
        }
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE + chat template
# ---------------------------------------------------------------------------------------------------------------

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END)  # ids 0..6 in this order
VOCAB_SIZE = 8192

# Every turn renders as `<|role|>\n{content}<|end|>\n`; the conversation opens with <|bos|>. `<|end|>` is the
# end-of-turn token generation stops at (the tokenizer's eos_token); `<|eos|>` separates documents in packed
# pretraining and is a second stop id in generation_config. The special tokens split the text before the
# byte-level pre-tokenizer runs, and "\n" is its own pre-token, so assistant content tokenizes exactly as it
# would alone. {% generation %} marks the assistant tokens that `return_assistant_tokens_mask=True` reports.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\n' }}{% generation %}{{- message['content'] + '<|end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- elif message['role'] in ['system', 'user'] %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- else %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)


def conversation_texts(conversations: Iterable[Conversation]) -> Iterable[str]:
    for conv in conversations:
        for message in conv.messages:
            yield message["content"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE over `texts` wrapped as a transformers fast tokenizer with the chat template set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE reached {backend.get_vocab_size()} tokens, wanted {vocab_size}: too little text")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        extra_special_tokens=[EOS, SYSTEM, USER, ASSISTANT],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,  # exact decode(encode(text)) round trip
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(model_dir: Path = DEFAULT_MODEL_DIR):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# ---------------------------------------------------------------------------------------------------------------
# Model: a small Llama trained from scratch on the packed training conversations
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainSettings:
    """Training recipe of the bundled verifier (a fixed seed and data order make it reproducible on one machine)."""

    steps: int = 600
    batch_size: int = 16  # sequences per step
    seq_len: int = 256  # tokens per packed sequence
    lr: float = 2e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 40
    weight_decay: float = 0.1  # on matrices only
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2  # torch intra-op threads
    log_every: int = 10
    bf16_autocast: bool = False  # matmuls in bf16 (weights and AdamW float32): 1.5x faster where the CPU has native
    # bf16 (kimi-mini's step on this project's AVX512-BF16 EPYC: 2.7 s against 4.2 s), far slower where it has not
    lr_scale: dict[str, float] = field(default_factory=dict)  # parameter-name substring -> multiplier of the lr
    # (the first match counts); none for the tiny Llama


def model_config(tokenizer, vocab_size: int = VOCAB_SIZE):
    """LlamaConfig of the bundled verifier: 4 layers, hidden 256, 8 heads / 4 KV heads, untied lm_head."""
    from transformers import LlamaConfig

    end_id, eos_id = tokenizer.convert_tokens_to_ids([END, EOS])
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,  # the pipeline reads lm_head.weight on its own
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[end_id, eos_id],
        pad_token_id=tokenizer.pad_token_id,
    )


def conversation_token_ids(tokenizer, conversations: Sequence[Conversation]) -> list[list[int]]:
    """Chat-template token ids of each conversation followed by <|eos|> (the document separator when packing)."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    texts = [tokenizer.apply_chat_template(c.messages, tokenize=False) for c in conversations]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids + [eos_id] for ids in encoded]


def pack(docs: Sequence[list[int]], seq_len: int, rng: random.Random | None = None) -> torch.Tensor:
    """Concatenate documents (shuffled by `rng` when given) and cut into [n, seq_len] rows; the tail is dropped."""
    import torch

    order = list(range(len(docs)))
    if rng is not None:
        rng.shuffle(order)
    stream = [t for i in order for t in docs[i]]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)  # [n, seq_len]


def _lr_at(step: int, s: TrainSettings) -> float:
    return lr_at(step, s.steps, s.lr, s.warmup_steps, "cosine", s.min_lr_ratio)


def _batches(docs: Sequence[list[int]], s: TrainSettings):
    """Endless [batch, seq_len] batches: every epoch re-shuffles documents (seeded) and re-packs them."""
    rng = random.Random(s.seed)
    while True:
        rows = pack(docs, s.seq_len, rng)  # [n_rows, seq_len]
        perm = list(range(rows.shape[0]))
        rng.shuffle(perm)
        for i in range(0, len(perm) - s.batch_size + 1, s.batch_size):
            yield rows[perm[i : i + s.batch_size]]  # [batch, seq_len]


def train_tiny_llama(tokenizer, train_docs: Sequence[list[int]], settings: TrainSettings, log=print):
    """Train the bundled verifier from scratch on CPU; returns (model in float32, history dict)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(settings.seed)
    return train_causal_lm(LlamaForCausalLM(model_config(tokenizer)).float(), train_docs, settings, log)


def train_causal_lm(model, train_docs: Sequence[list[int]], settings: TrainSettings, log=print):
    """Train a freshly initialised transformers causal LM on packed documents (next-token loss on every token, AdamW,
    warmup + cosine); returns (model in eval mode, history dict). The bundled verifiers (tiny Llama, kimi-mini) share
    this loop."""
    import torch

    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    groups: dict[tuple[bool, float], list] = {}  # (decayed, lr multiplier) -> parameters
    for name, p in model.named_parameters():
        if p.requires_grad:
            scale = next((v for k, v in settings.lr_scale.items() if k in name), 1.0)
            groups.setdefault((p.ndim >= 2, scale), []).append(p)
    optim = torch.optim.AdamW(
        [{"params": ps, "weight_decay": settings.weight_decay if decayed else 0.0, "lr_scale": scale}
         for (decayed, scale), ps in groups.items()],
        lr=settings.lr,
        betas=settings.betas,
    )
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[train] {n_params / 1e6:.2f}M parameters, {sum(map(len, train_docs))} training tokens, {settings}")
    model.train()
    losses: list[tuple[int, float]] = []
    window: list[float] = []
    start = time.time()
    batches = _batches(train_docs, settings)
    for step in range(settings.steps):
        batch = next(batches)  # [batch, seq_len]
        for group in optim.param_groups:
            group["lr"] = _lr_at(step, settings) * group["lr_scale"]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
            loss = model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optim.step()
        window.append(loss.item())
        if (step + 1) % settings.log_every == 0 or step + 1 == settings.steps:
            mean = sum(window) / len(window)
            losses.append((step + 1, round(mean, 4)))
            window = []
            elapsed = time.time() - start
            log(f"[train] step {step + 1}/{settings.steps} loss {mean:.4f} lr {_lr_at(step, settings):.2e} "
                f"{elapsed:.0f}s ({(step + 1) / elapsed:.2f} steps/s)")  # fmt: skip
    history = {
        "parameters": n_params,
        "train_tokens": sum(map(len, train_docs)),
        "wall_seconds": round(time.time() - start, 1),
        "loss_curve": losses,
        "final_train_loss": losses[-1][1],
    }
    return model.eval(), history


def eval_perplexity(model, tokenizer, conversations: Sequence[Conversation], seq_len: int = 256) -> dict:
    """Held-out perplexity per conversation (no packing across conversations): all tokens and assistant tokens."""
    import torch

    total = {"all": [0.0, 0], "assistant": [0.0, 0]}
    with torch.no_grad():
        for conv in conversations:
            enc = tokenizer.apply_chat_template(
                conv.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = torch.tensor(enc["input_ids"][:2048])[None]  # [1, seq]
            mask = torch.tensor(enc["assistant_masks"][:2048], dtype=torch.bool)[None]  # [1, seq]
            logits = model(input_ids=ids).logits.float()  # [1, seq, vocab]
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")  # [seq-1]
            target_mask = mask[0, 1:]  # token t+1 is predicted from position t
            total["all"][0] += nll.sum().item()
            total["all"][1] += nll.numel()
            total["assistant"][0] += nll[target_mask].sum().item()
            total["assistant"][1] += int(target_mask.sum())
    return {f"{k}_perplexity": round(math.exp(s / max(n, 1)), 3) for k, (s, n) in total.items()} | {
        f"{k}_tokens": n for k, (s, n) in total.items()
    }


def quality_prompts(eval_messages: Sequence[list[dict[str, str]]], n: int = 5) -> list[list[dict[str, str]]]:
    """The first `n` held-out conversations cut before their first assistant turn (the quality-gate prompts)."""
    prompts = []
    for messages in eval_messages:
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(list(messages[:first_answer]))
        if len(prompts) == n:
            break
    return prompts


def greedy_generate(
    model, tokenizer, messages: list[dict[str, str]], max_new_tokens: int = 64, ignore_eos: bool = False
) -> list[int]:
    """Greedy continuation of `messages` rendered with add_generation_prompt=True; returns the new token ids.

    `ignore_eos=True` always produces `max_new_tokens` tokens (as acceptance benchmarks run with ignore_eos): the
    quality gate uses it, because many docstring answers end in fewer than 64 tokens.
    """
    import torch

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    input_ids = torch.tensor([ids["input_ids"]])  # [1, prompt]
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else None,
            do_sample=False,
        )
    return out[0, input_ids.shape[1] :].tolist()


def longest_run(ids: Sequence[int]) -> int:
    """Length of the longest run of one repeated token."""
    best = run = 0
    prev = None
    for t in ids:
        run = run + 1 if t == prev else 1
        prev = t
        best = max(best, run)
    return best


def save_model(model, tokenizer, model_dir: Path) -> None:
    """bf16 safetensors + config + generation_config (stop on <|end|> and <|eos|>) + tokenizer files."""
    import torch
    from transformers import GenerationConfig

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(model_dir))
    model.float()
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(model.config.eos_token_id),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=256,
    ).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))


def load_model(model_dir: Path = DEFAULT_MODEL_DIR, dtype: str = "float32"):
    """The shipped verifier, upcast to `dtype` (float32 keeps greedy decoding stable on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def write_model_card(
    model_dir: Path,
    manifest: dict,
    settings: TrainSettings,
    history: dict,
    evaluation: dict,
    samples: Sequence[tuple[str, str]],
    command: str,
    git_revision: str | None = None,
) -> None:
    """README.md (the model card) and training.json (settings, loss curve, versions, the git revision it was
    built from: `git_revision`, or the current HEAD)."""
    model_dir = Path(model_dir)
    train, held = manifest["counts"]["train"], manifest["counts"]["eval"]
    record = {
        "settings": settings.__dict__,
        "history": history,
        "evaluation": evaluation,
        "data_manifest_sha256": manifest["sha256"],
        "versions": versions(),
        "git_revision": git_revision or current_revision() or "unknown",
        "command": command,
    }
    (model_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    sample_md = "\n\n".join(f"**Prompt:** {q}\n\n```text\n{a}\n```" for q, a in samples)
    curve = ", ".join(f"{s}: {v:.2f}" for s, v in history["loss_curve"][:: max(1, len(history["loss_curve"]) // 10)])
    card = f"""# tiny-chat-verifier

A {history["parameters"] / 1e6:.1f}M-parameter Llama chat model trained from scratch on conversations built from
Python standard-library docstrings. It is the bundled *verifier* (target model) this project uses in tests and the
demo, where no real LLM can be downloaded: small enough for 2 CPU cores, yet it produces varied, docstring-like
text (a random-init model repeats one token forever, which makes draft-acceptance measurements meaningless).
Not a useful assistant: after this short CPU training its answers are generic docstring prose, loosely tied to the
question asked (compare the held-out perplexity with the training loss below). That suffices for what the project
measures with it: a draft model has to learn to predict this verifier's own outputs.

## Architecture
`LlamaForCausalLM`: 4 layers, hidden 256, 8 attention heads / 4 KV heads (head_dim 32), intermediate 768 (SiLU),
vocab 8192, max_position_embeddings 2048, RoPE theta 10000, RMSNorm eps 1e-5, untied `lm_head.weight`.
Weights stored in bfloat16 (`model.safetensors`).

## Tokenizer and chat template
Byte-level BPE (the `tokenizers` library) trained on the training split's message text, vocab 8192, exact
round trip for any Unicode text. Special tokens: `<|bos|>` (0), `<|eos|>` (1, document separator), `<|pad|>` (2),
`<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>` (end of turn; the tokenizer's `eos_token`). Each turn renders
as `<|role|>\\n{{content}}<|end|>\\n` after a leading `<|bos|>`; `add_generation_prompt=True` appends
`<|assistant|>\\n`. Assistant content and its `<|end|>` are wrapped in `{{% generation %}}`, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` gives the loss mask. `generation_config.json` stops on
`<|end|>` and `<|eos|>`.

## Data
`data/stdlib-chat/` (ShareGPT and OpenAI jsonl, the same conversations in both). A user asks about a public function
or class of a module in one of several phrasings; the assistant answers with its docstring (`inspect.cleandoc`,
at most {MAX_DOC_CHARS} characters, cut at a paragraph boundary; docstrings under {MIN_DOC_CHARS} characters dropped).
About {int((TURN_WEIGHTS[1][1] + TURN_WEIGHTS[2][1]) * 100)}% of conversations ask follow-up questions about other
members of the same module; {int(SYSTEM_PROMPT_SHARE * 100)}% carry a system prompt. Python {manifest["python"]}.

| split | conversations | assistant turns | modules | characters | tokens (template) |
|---|---|---|---|---|---|
| train | {train["conversations"]} | {train["assistant_turns"]} | {train["modules"]} | {train["chars"]} | {history["train_tokens"]} |
| eval | {held["conversations"]} | {held["assistant_turns"]} | {held["modules"]} | {held["chars"]} | {evaluation["all_tokens"]} |

Held out for evaluation (never seen in training, nor by the tokenizer): every top-level module with
`sha256(name) % 100 < {HOLDOUT_PERCENT}`, with all its submodules: {len(manifest["eval_top_level_modules"])}
top-level modules ({", ".join(manifest["eval_top_level_modules"])}).

## Training
From scratch on CPU, seed {settings.seed}, {settings.threads} threads: AdamW (betas {settings.betas}, weight decay
{settings.weight_decay} on matrices), peak lr {settings.lr}, {settings.warmup_steps} warmup steps then cosine to
{settings.lr * settings.min_lr_ratio:g}, gradient clip {settings.grad_clip}, {settings.steps} steps of
{settings.batch_size} x {settings.seq_len}-token sequences packed from the training conversations (each followed by
`<|eos|>`; reshuffled every epoch; loss on all tokens). Wall time {history["wall_seconds"] / 60:.1f} minutes.

- Final training loss (mean of the last {settings.log_every} steps): **{history["final_train_loss"]:.3f}**
- Held-out perplexity (eval split, shipped bf16 weights): **{evaluation["all_perplexity"]:.2f}** over all tokens,
  **{evaluation["assistant_perplexity"]:.2f}** over assistant tokens
- Loss curve (step: loss): {curve}

Full settings, the loss curve, versions and the git revision are in `training.json`.

## Rebuild

```bash
{command}
```

## Sample greedy outputs (held-out prompts, at most 64 new tokens, stopping at `<|end|>`)

Quality gate (`tests/test_bundled_verifier.py`): 64 greedy tokens with end-of-turn ignored on these five prompts;
distinct tokens per prompt {evaluation["gate_distinct_tokens"]} (gate: at least 20), longest single-token run
{evaluation["gate_longest_run"]} (gate: under 8).

{sample_md}
"""
    (model_dir / "README.md").write_text(card)


# ---------------------------------------------------------------------------------------------------------------
# The whole rebuild
# ---------------------------------------------------------------------------------------------------------------


def build_data_and_tokenizer(data_dir: Path = DEFAULT_DATA_DIR, model_dir: Path = DEFAULT_MODEL_DIR, seed: int = 0):
    """Write the conversations (both splits, both formats) and the tokenizer (trained on the train split only)."""
    conversations = build_stdlib_conversations(seed=seed)
    manifest = write_dataset(data_dir, conversations, build_short_doc_conversations(seed=seed))
    train = split_conversations(conversations)["train"]
    tokenizer = train_tokenizer(conversation_texts(train))
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(model_dir))
    return conversations, manifest, tokenizer


def evaluate_shipped(model_dir: Path, eval_conversations: Sequence[Conversation]) -> tuple[dict, list]:
    """Held-out perplexity, quality-gate figures and sample answers of the model exactly as written to `model_dir`
    (bf16 weights upcast to float32); returns (evaluation, [(question, answer), ...])."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    evaluation = eval_perplexity(model, tokenizer, eval_conversations)
    samples = []
    for prompt in quality_prompts([c.messages for c in eval_conversations]):
        answer = greedy_generate(model, tokenizer, prompt)  # stops at <|end|>
        samples.append((prompt[-1]["content"], tokenizer.decode(answer)))
        gate_ids = greedy_generate(model, tokenizer, prompt, ignore_eos=True)  # exactly 64 tokens
        evaluation.setdefault("gate_distinct_tokens", []).append(len(set(gate_ids)))
        evaluation.setdefault("gate_longest_run", []).append(longest_run(gate_ids))
    return evaluation, samples


def build_tiny_verifier(
    data_dir: Path = DEFAULT_DATA_DIR,
    model_dir: Path = DEFAULT_MODEL_DIR,
    settings: TrainSettings | None = None,
    train_model: bool = True,
    command: str = "python tools/build_tiny_verifier.py",
    log=print,
) -> dict:
    """Rebuild data, tokenizer and (unless `train_model` is False) the model and its card; returns a summary."""
    settings = settings or TrainSettings()
    revision = current_revision() or "unknown"  # of the code that runs, before hours of training
    conversations, manifest, tokenizer = build_data_and_tokenizer(data_dir, model_dir, seed=settings.seed)
    log(f"[data] {json.dumps(manifest['counts'])}; eval modules {manifest['eval_top_level_modules']}")
    if not train_model:
        return {"manifest": manifest}
    splits = split_conversations(conversations)
    model, history = train_tiny_llama(tokenizer, conversation_token_ids(tokenizer, splits["train"]), settings, log)
    save_model(model, tokenizer, model_dir)
    evaluation, samples = evaluate_shipped(model_dir, splits["eval"])
    log(f"[eval] {evaluation}")
    write_model_card(model_dir, manifest, settings, history, evaluation, samples, command, revision)
    return {"manifest": manifest, "history": history, "evaluation": evaluation, "samples": samples}

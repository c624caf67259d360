"""The name cloze items (:mod:`vllm_lowrank.cloze`) and the lm-evaluation-harness
recipe through a running server (``benchmarks/lm_eval_cloze.py``)."""

from __future__ import annotations

import os
import re
import sys

import pytest
from conftest import REPO

from vllm_lowrank.cloze import first_word, name_cloze_items

ROOT = str(REPO)


@pytest.mark.parametrize("text, word", [
    (" Google's shares", "Google"), ("\n Time-Warner.", "Time-Warner"), (" 2004", ""),
    ("", ""), ("Rosneft", "Rosneft"), (" , Yukos", ""),
])
def test_first_word(text, word):
    assert first_word(text) == word


def test_items_follow_their_rule():
    """Every item: the article text up to the target, the target a name that
    occurred at least ``min_gap_words`` words earlier in the same article and
    does not start a sentence; the preceding articles' tail fills the context;
    the last qualifying name of an article is taken; articles without one give
    no item."""
    filler = " ".join(f"w{i}" for i in range(60))
    docs = [
        "Alpha beta. " + filler + " said Mr Smith.",           # Smith only once: none
        "Then Jones came. " + filler + " and Jones left, Jones said. " + filler
        + " It was Brown; " + filler + " met Brown.",          # Jones at 1 and 63: gap 62
        "Short doc with Kent and Kent.",                       # gap 2 < 40: none
    ]
    items = name_cloze_items(docs, 1, context_words=200, min_gap_words=40)
    (item,) = items
    # the last qualifying name of doc 2 is "Brown" (its first occurrence 60+ words before)
    assert item["target"] == "Brown"
    ctx = item["context"]
    assert ctx.endswith("met") and not ctx.endswith(" ")
    head, article = ctx.split("\n\n")
    assert docs[1].startswith(article) and docs[1][len(article):] == " Brown."
    # the tail of doc 1 fills the context up to 200 words
    words_before = len(article.split())
    assert head.split() == docs[0].split()[-(200 - words_before):]
    with pytest.raises(ValueError, match="1 cloze items, fewer than 2"):
        name_cloze_items(docs, 2, context_words=200, min_gap_words=40)


def test_sentence_starts_are_not_targets():
    filler = " ".join(f"w{i}" for i in range(50))
    docs = ["Paris is big. " + filler + ". Paris again."]
    with pytest.raises(ValueError):
        name_cloze_items(docs, 1, min_gap_words=10)
    docs = ["Paris is big. " + filler + " in Paris again."]
    assert name_cloze_items(docs, 1, min_gap_words=10)[0]["target"] == "Paris"


def test_held_out_items_come_from_the_unread_half_of_bbc():
    """The benchmark's items: 200 from the first half of the BBC articles
    (the calibration mix reads the second half), each ending where that text
    has the target; each target occurs earlier in its context."""
    from vllm_lowrank.calibration.text import bbc_news

    docs = list(bbc_news())
    items = name_cloze_items(docs[:len(docs) // 2], 200)
    assert len(items) == 200
    first_half = "\n".join(docs[:len(docs) // 2])
    for item in items:
        assert re.search(rf"\b{item['target']}\b", item["context"])
        assert item["context"][-80:] + " " + item["target"] in first_half


@pytest.mark.slow
def test_lm_eval_recipe_scores_the_server(model_path, tmp_path):
    """The recipe: lm-evaluation-harness (``local-completions``) against a
    running server with the default preset. lm-eval's recorded responses are
    the server's own greedy completions (asked again directly), and its
    accuracy is the mean first-word exact match of those (computed here)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import lm_eval_cloze as rec
    from openai import OpenAI

    from server_harness import Server

    lm_eval = rec.ensure_lm_eval(os.path.join(ROOT, ".venv-lmeval"))
    from vllm_lowrank.calibration.text import bbc_news

    docs = list(bbc_news())
    items = name_cloze_items(docs[:len(docs) // 2], 8)
    include = rec.write_task(str(tmp_path / "task"), items)
    # One request at a time and no prefix cache: lm-eval's requests and the
    # direct ones then run the same batches (a near tie in a different batch
    # may pick another token).
    server = Server(model_path, "--kv-compression", "lowrank", "--no-enable-prefix-caching",
                    log_dir=str(tmp_path))
    try:
        assert server.metric("vllm_lowrank_kv_compression_ratio") > 1.5
        result = rec.run_lm_eval(lm_eval, include, server.url + "/v1", "m",
                                 str(tmp_path / "out"), concurrent=1)
        client = OpenAI(base_url=server.url + "/v1", api_key="x")
        direct = [client.completions.create(model="m", prompt=it["context"], max_tokens=8,
                                            temperature=0, stop=["\n", ".", ","])
                  .choices[0].text for it in items]
    finally:
        server.stop()
    assert [s["doc"]["target"] for s in result["samples"]] == [it["target"] for it in items]
    assert [s["resp"] for s in result["samples"]] == direct
    matches = [float(first_word(t) == it["target"]) for t, it in zip(direct, items)]
    assert [s["match"] for s in result["samples"]] == matches
    assert result["acc"] == pytest.approx(sum(matches) / len(matches))

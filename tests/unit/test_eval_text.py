"""Perplexity on a user's own text: ``vllm-lowrank perplexity --text FILE``."""

from __future__ import annotations

import json
import re

import pytest


def test_own_file_gives_its_own_tokens(tmp_path, model_path):
    from transformers import AutoTokenizer

    from vllm_lowrank.evaluation import eval_windows

    tok = AutoTokenizer.from_pretrained(model_path)
    text = " ".join(f"Line {i} of a held-out report on river levels." for i in range(200))
    path = tmp_path / "mine.txt"
    path.write_text(text)
    windows = eval_windows(tok, str(path), 2, 64)
    ids = tok.encode(text + "\n\n", add_special_tokens=False)
    assert windows == [ids[:64], ids[64:128]]

    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": text}) for _ in range(2)))
    assert eval_windows(tok, str(jsonl), 2, 64) == windows


@pytest.mark.parametrize("content,match", [(None, "does not exist|not found|no such"),
                                           ('{"txt": 1}\n', "string \"text\" field")])
def test_bad_file_is_refused_before_any_engine(tmp_path, capsys, content, match):
    from vllm_lowrank import cli

    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        cli.main(["perplexity", "not-a-model-folder", "--text", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("vllm-lowrank: error:")
    assert re.search(match, err, re.I), err


def test_every_held_out_domain_gives_windows_of_its_own_text(model_path):
    """The four evaluation domains (encyclopedia, news, drama, code) each give
    full windows of distinct text, none of it from the calibration split."""
    from transformers import AutoTokenizer

    from vllm_lowrank.calibration import text as texts
    from vllm_lowrank.evaluation import TEXTS, eval_windows

    assert set(TEXTS) == set(texts.HELD_OUT) == {"wikipedia", "bbc", "shakespeare", "code"}
    tok = AutoTokenizer.from_pretrained(model_path)
    firsts = set()
    for name in TEXTS:
        windows = eval_windows(tok, name, 2, 1024)
        assert [len(w) for w in windows] == [1024, 1024], name
        firsts.add(tuple(windows[0][:64]))
    assert len(firsts) == len(TEXTS)
    plays = texts.shakespeare()
    assert len(plays) == 38 and "Hamlet" in " ".join(p[:40] for p in plays)
    assert not any("**" in p for p in plays)  # markdown emphasis removed
    calibration = set(texts.wikipedia_split("calibration"))
    assert not calibration & set(texts.HELD_OUT["wikipedia"]())


def test_calibration_mix_leaves_the_evaluation_text_and_code_out(model_path):
    """The ``mix`` calibration text alternates Wikipedia, news and drama, reads
    none of the text the evaluation windows of those domains come from (4
    windows of 4,096 tokens each), and no code: ``code`` is the domain no
    calibration sees."""
    from transformers import AutoTokenizer

    from vllm_lowrank.calibration import text as texts
    from vllm_lowrank.evaluation import eval_windows

    tok = AutoTokenizer.from_pretrained(model_path)
    mix = texts.calibration_mix()
    assert texts.calibration_documents("mix") == mix
    assert texts.calibration_documents() == texts.wikipedia_split("calibration")  # default
    joined = "\n\n".join(mix)
    for name in ("wikipedia", "bbc", "shakespeare", "code"):
        for window in eval_windows(tok, name, 4, 4096):
            probe = tok.decode(window[1000:1040])  # 40 tokens inside the window
            assert probe not in joined, name
    news, plays = texts.bbc_news(), texts.shakespeare()
    first = mix[:3]  # one piece of each domain, in turn
    assert first[0] in texts.wikipedia_split("calibration")[0]
    assert any(first[1] in d for d in news[len(news) // 2:])
    assert any(first[2] in d for d in plays[len(plays) // 2:])
    code = texts.python_code()
    assert not any(doc[:200] in joined for doc in (code[0], code[len(code) // 2], code[-1]))


def test_compressed_windows_advance_in_prefill_chunks_however_many_run():
    """A compressed setting's windows advance at most the plugin's prefill
    chunk per engine step, with a step budget of one chunk per window side by
    side: vLLM 0.32 drops the per-request threshold while one request is
    eligible, so a single window would otherwise be prefilled in one step (every
    token seeing exact keys only). ``step_tokens`` sets the chunk; the
    uncompressed baseline keeps vLLM's defaults."""
    from vllm_lowrank.evaluation import engine_kwargs
    from vllm_lowrank.format.exact import PREFILL_CHUNK_TOKENS

    spec = {"model": "m", "window": 4096, "num_windows": 1, "compression": {"preset": "4x"}}
    one = engine_kwargs(spec)
    assert one["long_prefill_token_threshold"] == PREFILL_CHUNK_TOKENS
    assert one["max_num_batched_tokens"] == PREFILL_CHUNK_TOKENS
    assert one["enable_chunked_prefill"] is True
    three = engine_kwargs({**spec, "num_windows": 3, "step_tokens": 32})
    assert (three["long_prefill_token_threshold"], three["max_num_batched_tokens"]) == (32, 96)
    base = engine_kwargs({**spec, "compression": None})
    assert "long_prefill_token_threshold" not in base and "max_num_batched_tokens" not in base


def test_subprocess_runner_returns_the_result_and_reports_a_timeout_with_its_output(tmp_path):
    """``in_subprocess`` returns the worker's JSON; past its timeout it raises
    with what the worker printed so far (where an engine stopped), not a bare
    ``TimeoutExpired`` that drops it."""
    from vllm_lowrank.evaluation import in_subprocess

    (tmp_path / "slow_worker.py").write_text(
        "import time\n"
        "def double(spec):\n"
        "    return {'x': 2 * spec['x']}\n"
        "def stuck(spec):\n"
        "    print('loading layer', spec['x'], flush=True)\n"
        "    time.sleep(60)\n")
    assert in_subprocess("slow_worker:double", {"x": 21}, what="double",
                         path=str(tmp_path)) == {"x": 42}
    with pytest.raises(RuntimeError, match=r"(?s)stuck ran past 5 s.*loading layer 7"):
        in_subprocess("slow_worker:stuck", {"x": 7}, what="stuck", path=str(tmp_path),
                      timeout=5)

"""Passkey retrieval: a 5-digit key hidden at several depths of a long real-text
haystack (Mohtashami & Jaggi 2023 protocol, with real text instead of repeated
filler). Exact match of the generated digits; greedy decoding through vLLM.

The haystack is held-out Wikipedia (gensim excerpt) text, so neither the key
nor the filler was seen in calibration.
"""

from __future__ import annotations

import random
import re

INTRO = ("There is an important piece of information hidden inside a lot of "
         "irrelevant text. Find it and memorize it. I will quiz you about it.\n\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompts(tokenizer, num_cases: int, context_tokens: int,
                    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9),
                    seed: int = 0) -> list[tuple[list[int], str, float]]:
    """Token-id prompts of about ``context_tokens`` tokens.

    Returns:
        ``(prompt_ids, key, depth)`` per case; cases cycle over ``depths``
        and over different haystack offsets.
    """
    from vllm_lowrank.calibration.text import adds_bos, wikipedia_split

    rng = random.Random(seed)
    haystack: list[int] = []
    for doc in wikipedia_split("heldout"):
        haystack.extend(tokenizer.encode(doc + "\n\n", add_special_tokens=False))
    intro = ([tokenizer.bos_token_id] if adds_bos(tokenizer) else []) + tokenizer.encode(
        INTRO, add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    cases = []
    for n in range(num_cases):
        key = f"{rng.randint(10000, 99999)}"
        needle = tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False)
        filler = context_tokens - len(intro) - len(needle) - len(question)
        start = rng.randint(0, len(haystack) - filler - 1)
        text = haystack[start:start + filler]
        depth = depths[n % len(depths)]
        cut = int(depth * len(text))
        ids = intro + text[:cut] + needle + text[cut:] + question
        cases.append((ids, key, depth))
    return cases


def passkey_accuracy(llm, num_cases: int = 20, context_tokens: int = 4096,
                     seed: int = 0) -> dict[str, float]:
    """Exact-match accuracy of ``llm`` (a ``vllm.LLM``) on passkey prompts.

    Returns:
        ``{"accuracy", "cases", "by_depth": {depth: accuracy}}``.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cases = passkey_prompts(llm.get_tokenizer(), num_cases, context_tokens, seed=seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=c[0]) for c in cases],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    hits: dict[float, list[bool]] = {}
    for (_, key, depth), out in zip(cases, outs):
        digits = re.findall(r"\d+", out.outputs[0].text)
        hits.setdefault(depth, []).append(bool(digits) and digits[0] == key)
    total = [h for hs in hits.values() for h in hs]
    return {"accuracy": sum(total) / len(total), "cases": len(total),
            "by_depth": {str(d): sum(h) / len(h) for d, h in sorted(hits.items())}}

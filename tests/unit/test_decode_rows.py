"""Decode rows of a speculative verify step (:class:`vllm_lowrank.attention.backend.DecodeRows`):
each query token of a decode request decodes as a one-token step whose
context ends at that token. Reference: the prefill path, which attends a
chunk of new tokens causally (a float32 computation of the same softmax
by a different route)."""

from __future__ import annotations

import pytest
import torch

from test_latent_attention import BLOCK, fill, setup_case
from vllm_lowrank.attention import latent_attention as ops
from vllm_lowrank.attention.backend import DecodeRows, LatentAttentionMetadata
from vllm_lowrank.attention.decoders import decode_rows


def _naive_rows(q_lens):
    req, back = [], []
    for r, q in enumerate(q_lens):
        for i in range(q):
            req.append(r)
            back.append(q - 1 - i)
    return req, back


@pytest.mark.parametrize("q_lens", [[4, 4, 1, 2], [1, 3], [2, 1, 1, 1]])
def test_rows_follow_each_requests_tokens(q_lens):
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    req, back = decode_rows(qsl, len(q_lens))
    assert (req.tolist(), back.tolist()) == _naive_rows(q_lens)


def test_one_token_requests_need_no_rows():
    assert decode_rows(torch.arange(6, dtype=torch.int32), 5) is None


def test_a_padded_uniform_batch_gives_its_padding_requests_rows():
    # a CUDA graph of 4 requests x 3 tokens replayed for 2 real requests: the
    # padding requests have no tokens but the graph decodes 12 rows
    qsl = torch.tensor([0, 3, 6, 6, 6], dtype=torch.int32)
    req, back = decode_rows(qsl, 4)
    assert (req.tolist(), back.tolist()) == _naive_rows([3, 3, 3, 3])


@pytest.mark.parametrize("window", [None, 6])
def test_verify_rows_equal_the_prefill_path(window):
    plan, k_up, rope, cache = setup_case()
    lens, q_lens = [13, 7, 9], [4, 1, 3]  # context after the step; tokens in it
    tables = torch.zeros(3, 6, dtype=torch.int32)
    perm = torch.randperm(24)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // BLOCK)
        tables[b, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        fill(cache, tables[b], torch.randn(n, plan.k_width + plan.v_width))
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(int(qsl[-1]), 8, 16)
    req, back = decode_rows(qsl, 3)
    m = LatentAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_decodes=3, query_start_loc_cpu=qsl,
        query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(lens), block_table=tables, slot_mapping=torch.zeros(0),
        max_decode_seq_len=max(lens), min_decode_seq_len=0,
        rows=DecodeRows(req, back, max_query_len=max(q_lens)))
    batch = m.decode_batch()
    assert m.num_decode_tokens == query.shape[0] == batch.size
    # a decoder that takes several query tokens per sequence gets the requests
    per_request = m.decode_batch(query_tokens=True)
    assert per_request.size == 3 and per_request.max_query_len == 4
    assert per_request.query_start_loc.tolist() == qsl.tolist()
    got = ops.decode_attention(plan, k_up, rope, 0.25, query, cache, batch.block_table,
                               batch.seq_lens, batch.max_seq_len, window=window,
                               min_seq_len=batch.min_seq_len)
    for r in range(3):
        start, stop = int(qsl[r]), int(qsl[r + 1])
        want = ops.prefill_attention(plan, k_up, rope, 0.25, query[start:stop], cache,
                                     tables[r], lens[r], window=window)
        torch.testing.assert_close(got[start:stop], want, rtol=1e-5, atol=1e-5)

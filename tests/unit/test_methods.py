"""Each calibration method on synthetic statistics where the optimum is known."""

import pytest
import torch

from vllm_lowrank.calibration.calibrate import layer_bases
from vllm_lowrank.calibration.collect import LayerStats, distance_mass
from vllm_lowrank.config import LowRankConfigError
from vllm_lowrank.factorization.bases import factors_for_rank, rope_query_metric

H, KV, D, HID = 4, 2, 8, 24
torch.manual_seed(0)


def _stats(x, q=None, gk=None, gv=None, dist=None):
    st = LayerStats(sx=x.T @ x, tokens=x.shape[0])
    st.sq = q
    st.gk, st.gv, st.dist = gk, gv, dist
    return st


def _kw(group):
    return dict(num_heads=H, num_kv_heads=KV, head_dim=D, group_size=group,
                inv_freq=torch.tensor([1.0, 0.5, 0.1, 0.01]))


def _weights():
    return (torch.randn(KV * D, HID), torch.randn(KV * D, HID), torch.randn(HID, H * D))


def _low_rank_inputs(rank, n=300):
    return (torch.randn(n, rank) @ torch.randn(rank, HID)).double()


@pytest.mark.parametrize("method", ["whitened", "eigen", "kq", "fisher"])
def test_exact_recovery_when_inputs_are_low_rank(method):
    """If X spans only r dimensions, every data-aware method rebuilds X W
    exactly at rank r (the weight-only SVD does not)."""
    w_k, w_v, w_o = _weights()
    x = _low_rank_inputs(4)
    # eigen: no query energy, so its PCA sees the keys only; kq: any full-rank
    # query metric (errors are measured through the queries).
    q = torch.zeros(H, D, D, dtype=torch.float64)
    if method == "kq":
        q = torch.randn(H, D, D, dtype=torch.float64)
        q = q @ q.transpose(1, 2) + torch.eye(D, dtype=torch.float64)
    g = torch.eye(KV * D, dtype=torch.float64) * x.shape[0]
    st = _stats(x, q=q, gk=g, gv=g, dist=torch.ones(H, 16, dtype=torch.float64))
    kb, vb = layer_bases(method, w_k, w_v, w_o, st, **_kw(KV))
    for w, basis in ((w_k, kb[0]), (w_v, vb[0])):
        a, b = factors_for_rank(basis, 4, w.T)
        err = x.float() @ (w.T - a @ b)
        assert err.norm() <= 1e-3 * (x.float() @ w.T).norm()
    kb_svd, _ = layer_bases("svd", w_k, w_v, w_o, st, **_kw(KV))
    a, b = factors_for_rank(kb_svd[0], 4, w_k.T)
    assert (x.float() @ (w_k.T - a @ b)).norm() > 1e-2 * (x.float() @ w_k.T).norm()


def test_eigen_basis_is_top_eigenspace_of_keys_and_queries():
    w_k, w_v, w_o = _weights()
    x = torch.randn(500, HID, dtype=torch.float64)
    q = torch.randn(H, D, D, dtype=torch.float64)
    q = q @ q.transpose(1, 2) * 50
    st = _stats(x, q=q)
    kb, _ = layer_bases("eigen", w_k, w_v, w_o, st, **_kw(1))
    wk0 = w_k[:D].double().T
    m = wk0.T @ (x.T @ x / 500) @ wk0 + q[:2].sum(0) / 500
    evals, evecs = torch.linalg.eigh(m)
    top = evecs[:, -3:]
    proj_ref = top @ top.T
    b = kb[0].b[:3].double()
    assert torch.allclose(b.T @ b, proj_ref, atol=1e-4)


def _kfac_problem(method):
    """Random weights, inputs and a Fisher metric: ``(w_k, method's key bases,
    S_x, G, objective)`` with ``S_x``, ``G`` per token and ``objective(a, b,
    t)`` = ``tr(S_x E T E^T)`` of a key factorization (``E = W - a b``) in a
    metric ``T``."""
    w_k, w_v, w_o = _weights()
    x = torch.randn(400, HID, dtype=torch.float64)
    gm = torch.randn(KV * D, KV * D, dtype=torch.float64)
    gm = gm @ gm.T
    kb, _ = layer_bases(method, w_k, w_v, w_o, _stats(x, gk=gm, gv=gm), **_kw(KV))
    sx = x.T @ x / 400

    def objective(a, b, t):
        e = w_k.T.double() - a.double() @ b.double()
        return float(torch.trace(sx @ e @ t @ e.T))

    return w_k, kb, sx, gm / 400, objective


def test_fisher_minimises_the_kfac_objective():
    """fisher == closed form of tr(S_x E G E^T) with the collected moments;
    no other rank-r factorization does better on that objective."""
    w_k, kb, sx, g, kfac = _kfac_problem("fisher")

    def objective(a, b):
        return kfac(a, b, g)

    a, b = factors_for_rank(kb[0], 5, w_k.T)
    best = objective(a, b)
    assert best == pytest.approx(float(kb[0].energy[5:].double().sum()), rel=1e-3)
    for _ in range(10):
        ra = torch.randn(HID, 5, dtype=torch.float64)
        # optimal B for this A under the same objective: (A^T Sx A)^{-1} A^T Sx W
        rb = torch.linalg.solve(ra.T @ sx @ ra, ra.T @ sx @ w_k.T.double())
        assert best <= objective(ra, rb) * (1 + 1e-6)


def test_post_rope_basis_from_rotated_moments():
    w_k, w_v, w_o = _weights()
    x = torch.randn(300, HID, dtype=torch.float64)
    q = torch.randn(H, D, D, dtype=torch.float64)
    q = q @ q.transpose(1, 2)
    st = _stats(x, q=q)
    kw = _kw(1)
    kb, _ = layer_bases("post_rope", w_k, w_v, w_o, st, **kw)
    wk0 = w_k[:D].double().T
    m = wk0.T @ (x.T @ x / 300) @ wk0 + q[:2].sum(0) / 300
    from vllm_lowrank.calibration.calibrate import WINDOW

    ref = rope_query_metric(m, kw["inv_freq"], torch.ones(WINDOW, dtype=torch.float64))
    evals = torch.linalg.eigvalsh(ref).flip(0)
    assert torch.allclose(kb[0].energy.double(), evals.clamp_min(0), rtol=1e-4, atol=1e-6)
    with pytest.raises(LowRankConfigError, match="group_size 1"):
        layer_bases("post_rope", w_k, w_v, w_o, st, **_kw(2))


def test_distance_mass_sums_each_diagonal():
    p = torch.softmax(torch.randn(2, 3, 5, 5).masked_fill(
        torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf")), -1)
    out = distance_mass(p)
    for h in range(3):
        for delta in range(5):
            ref = sum(float(p[b, h, m, m - delta]) for b in range(2) for m in range(delta, 5))
            assert out[h, delta] == pytest.approx(ref, rel=1e-5)


def _rotate_keys(k, pos, inv_freq):
    """Naive neox RoPE of ``k [T, heads, D]`` at positions ``pos [T]`` (float64)."""
    ang = pos[:, None] * inv_freq[None, :]
    c, s = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = k.shape[-1] // 2
    return k * c + torch.cat([-k[..., half:], k[..., :half]], -1) * s


def test_rope_equivariant_basis_commutes_with_rope():
    """RoPE of the rebuilt keys == the rebuild of the latent rotated pair by pair
    (pair l by theta_f t, f from latent_frequencies), at every even rank; the
    fisher basis of the same statistics does not commute."""
    from vllm_lowrank.factorization.bases import latent_frequencies

    w_k, w_v, w_o = _weights()
    x = torch.randn(300, HID, dtype=torch.float64)
    gm = torch.randn(KV * D, KV * D, dtype=torch.float64)
    st = _stats(x, gk=gm @ gm.T, gv=gm @ gm.T)
    inv = _kw(KV)["inv_freq"].double()
    kb, _ = layer_bases("rope_equivariant", w_k, w_v, w_o, st, **_kw(KV))
    fb, _ = layer_bases("fisher", w_k, w_v, w_o, st, **_kw(KV))
    xs, pos = torch.randn(6, HID, dtype=torch.float64), torch.arange(6.0, dtype=torch.float64) * 7
    for r in (2, 6, 10):
        a, b = (t.double() for t in factors_for_rank(kb[0], r, w_k.T))
        want = _rotate_keys((xs @ a @ b).view(6, KV, D), pos, inv)
        lat, f = xs @ a, latent_frequencies(kb[0].b[:r], D)
        ang = pos[:, None] * inv[f][None, :]
        re, im = lat[:, 0::2], lat[:, 1::2]
        rot = torch.stack([re * ang.cos() - im * ang.sin(), re * ang.sin() + im * ang.cos()], -1)
        got = (rot.reshape(6, r) @ b).view(6, KV, D)
        assert torch.allclose(got, want, atol=1e-9 * want.abs().max())
    with pytest.raises(ValueError, match="complex-linear"):
        latent_frequencies(fb[0].b[:4], D)


def test_rope_equivariant_energy_is_the_rotation_averaged_objective():
    """The error left at rank r, tr(S_x E T~ E^T) with T~ the Fisher metric
    averaged over independent rotations of each frequency (computed here from
    8 angles per frequency), equals the energies past r, and no
    complex-linear map of the same rank built from a random basis does better."""
    w_k, kb, _, g, kfac = _kfac_problem("rope_equivariant")
    # RoPE turns each frequency f by its own angle: T~ keeps no block between two
    # frequencies, and averages each frequency's own block over its rotations.
    eye = torch.eye(KV * D, dtype=torch.float64)
    t_avg = 0
    for f in range(D // 2):
        dims = (torch.arange(KV * D) % (D // 2)) == f
        g_f = g * (dims[:, None] & dims[None, :])
        for phi in torch.arange(8, dtype=torch.float64) * (torch.pi / 4):
            angles = torch.zeros(D // 2, dtype=torch.float64)
            angles[f] = phi
            rot = _rotate_keys(eye.view(-1, KV, D), torch.tensor([1.0], dtype=torch.float64),
                               angles).reshape(KV * D, -1)
            t_avg = t_avg + rot @ g_f @ rot.T / 8

    def objective(a, b):
        return kfac(a, b, t_avg)

    r = 6
    a, b = factors_for_rank(kb[0], r, w_k.T)
    best = objective(a, b)
    assert best == pytest.approx(float(kb[0].energy[r:].double().sum()), rel=1e-6)
    assert float(kb[0].energy.double().sum()) == pytest.approx(objective(a * 0, b), rel=1e-6)
    for _ in range(5):
        # a random complex-linear rank-r map: 3 complex components on random frequencies
        rb = torch.zeros(r, KV * D, dtype=torch.float64)
        for k, f in enumerate(torch.randperm(D // 2)[:r // 2].tolist()):
            u = torch.randn(KV, dtype=torch.complex128)
            idx = torch.arange(KV) * D + f
            rb[2 * k, idx], rb[2 * k, idx + D // 2] = u.real, u.imag
            rb[2 * k + 1, idx], rb[2 * k + 1, idx + D // 2] = -u.imag, u.real
        # the best A for this B under the averaged metric (weighted least squares)
        ra = w_k.T.double() @ t_avg @ rb.T @ torch.linalg.inv(rb @ t_avg @ rb.T)
        assert best <= objective(ra, rb) * (1 + 1e-9)


def test_rope_equivariant_needs_rope_over_the_whole_head():
    w_k, w_v, w_o = _weights()
    x = torch.randn(50, HID, dtype=torch.float64)
    st = _stats(x, gk=torch.eye(KV * D, dtype=torch.float64), gv=torch.eye(KV * D, dtype=torch.float64))
    kw = dict(_kw(KV), inv_freq=torch.tensor([1.0, 0.5]))
    with pytest.raises(LowRankConfigError, match="whole head"):
        layer_bases("rope_equivariant", w_k, w_v, w_o, st, **kw)


def test_post_rope_without_an_artifact_needs_keys_at_full_width():
    """Without an artifact the key basis of a full-width side is the identity,
    which commutes with RoPE: such layers stay post-RoPE whatever their value
    ranks; a lower key rank (weight SVD, not a post-RoPE basis) does not."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
    from vllm_lowrank.models.compression import ModelCompression

    shape = AttentionShape(hidden_size=HID, num_heads=H, num_kv_heads=KV, head_dim=D)

    def post_rope(method, k_rank, v_rank):
        cfg = LowRankConfig.from_dict({"mode": "lowrank", "method": method,
                                       "head_group_size": 1, "artifact": "none",
                                       "rank_allocation": "uniform",
                                       "ranks": {"0": [KV * k_rank, KV * v_rank]}})
        plans = {0: LayerPlan(shape, 1, (k_rank,) * KV, (v_rank,) * KV)}
        return ModelCompression(cfg=cfg, plans=plans, artifact=None,
                                artifact_path=None).post_rope

    assert post_rope("post_rope", D, D // 2)
    assert not post_rope("post_rope", D // 2, D)
    assert not post_rope("svd", D, D // 2)

"""Closed-form low-rank bases for the key and value projections.

One head group's key (or value) projection is ``W`` (``hidden x n``, ``n =
group_size * head_dim``, applied as ``x @ W``). We look for ``A`` (``hidden x r``)
and ``B`` (``r x n``) so that the cached latent ``c = x @ A`` rebuilds
``x @ A @ B ~ x @ W``. All three methods minimise one objective,

    min_{A, B}  || X (W - A B) M ||_F^2                                   (1)

over calibration inputs ``X`` (``tokens x hidden``, with second moment
``S_x = X^T X``) and an output metric ``T = M M^T`` (``n x n``) that says which
errors in the rebuilt heads matter. With ``S_x = L L^T`` (Cholesky) and
``Z = L^T W M = U S V^T`` (SVD), the minimiser is

    A = L^{-T} U_r,        B = U_r^T L^T W                                (2)

and the objective left at rank ``r`` is ``sum_{i > r} s_i^2`` (Eckart-Young on
``Z``; proof: ``||X Y||_F = ||L^T Y||_F`` for any ``Y``, and ``X A B M =
X L^{-T} U_r U_r^T Z``). The latent ``x A`` is white on the calibration data
(``A^T S_x A = I``), which also makes it easy to quantize.

The methods differ only in ``S_x`` and ``T``:

- ``svd``: ``S_x = I``, ``T = I``: plain SVD of the weight (Palu eq. 4).
- ``whitened``: ``S_x`` from calibration, ``T = I``: truncation-aware SVD with
  Cholesky whitening (SVD-LLM eq. 5-7; Palu appendix K).
- ``kq``: ``S_x`` from calibration and an attention-aware ``T``:
    * keys: the error that matters is in the scores ``q^T R_{m-n} k`` (RoPE:
      ``R``), so ``T_k = sum_{i in group} E_delta[R_delta Sigma_{q_i}
      R_delta^T]`` (:func:`rope_query_metric`), with ``Sigma_{q_i}`` the pre-RoPE
      second moment of query head ``i`` and ``delta`` the query-key distance
      weighted by calibration attention. This is the K Q^T objective of Lesens,
      Rakhshan & Rabusseau (2025, "Approximating the attention matrix" and
      "Compatibility with GQA"), written in weight space, made RoPE-aware, and
      summing the squared errors of the group's query heads (the slides' GQA
      theorem sums the queries instead).
    * values: the V-O criterion ``min ||V C D^T W_O - V W_O||`` of the same
      slides: ``T_v = sum_{i reading kv head j} W_O^{(i)} W_O^{(i)T}``
      (:func:`value_output_metric`), i.e. errors are measured after ``o_proj``.

Two methods are PCA in the output space instead (orthonormal ``B``, ``A = W B^T``):

- ``eigen``: eigenvectors of ``W^T S_x W + S_q`` (keys stacked with the group's
  pre-RoPE queries) and of ``W_v^T S_x W_v`` (values): Eigen Attention sec. 4.1
  (Saxena et al. 2024), from second moments instead of stacked samples.
- ``post_rope``: eigenvectors of the post-RoPE second moments of keys and
  queries, ``E_t[R_t (W^T S_x W + S_q) R_t^T]`` over positions (ZACK sec. 4,
  Zhang & Shen 2025): queries and keys are then projected *after* RoPE and
  attention scores are computed in the latent space without a key rebuild.

One method constrains the key basis so that RoPE commutes with it:

- ``rope_equivariant``: the Fisher objective of ``fisher`` with the key
  up-projection restricted to complex-linear maps per RoPE frequency across the
  group's heads (:func:`rope_equivariant_basis`). RoPE multiplies frequency
  ``f`` of every head by the same ``e^{i theta_f t}``, so such a ``B`` satisfies
  ``R_t B^T = B^T R~_t`` with ``R~_t`` rotating latent pairs: the latent can be
  rotated instead of the rebuilt keys and queries absorbed into it (MLA-style
  decode). TransMLA's RoRoPE (Meng et al. 2025, sec. 4.2) is the special case
  of a real orthogonal map across heads.

At full rank (``r = n``) any basis is exact; :func:`factors_for_rank` then
returns the identity basis (``A = W``, ``B = I``), so the cached latent equals
the key or value bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class GroupBasis:
    """Full, ordered basis of one side (K or V) of one head group.

    Attributes:
        a: ``[hidden, k]`` float32 down-projection (columns ordered by energy).
        b: ``[k, n]`` float32 up-projection.
        energy: ``[k]`` float32, objective (1) removed by each component
            (descending); ``k = min(hidden, n)``.
    """

    a: torch.Tensor
    b: torch.Tensor
    energy: torch.Tensor

    @property
    def full_width(self) -> int:
        """``n``, the group's full K or V width."""
        return self.b.shape[1]


def _sym_sqrt(t: torch.Tensor) -> torch.Tensor:
    """Symmetric PSD square root (negative eigenvalues from rounding clamped)."""
    evals, evecs = torch.linalg.eigh(t)
    return (evecs * evals.clamp_min(0).sqrt()) @ evecs.T


def _cholesky(s: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of ``s``, with the smallest diagonal damping
    (1e-6 .. 1e-1 of the mean diagonal) that makes it positive definite."""
    scale = s.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
    for damp in (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
        chol, info = torch.linalg.cholesky_ex(s + damp * scale * eye)
        if int(info) == 0:
            return chol
    raise ValueError("calibration second moment is not positive semi-definite")


def output_aware_basis(
    w: torch.Tensor,
    sx: torch.Tensor | None = None,
    t: torch.Tensor | None = None,
) -> GroupBasis:
    """Solve objective (1) of the module docstring for every rank at once.

    Args:
        w: ``[hidden, n]`` projection of one head group (``x @ w``).
        sx: ``[hidden, hidden]`` input second moment ``X^T X``; ``None`` = identity.
        t: ``[n, n]`` PSD output metric; ``None`` = identity.

    Returns:
        The ordered basis; truncate with :func:`factors_for_rank`.

    Raises:
        ValueError: ``sx`` is not PSD even after damping, or shapes disagree.
    """
    w64 = w.detach().to(torch.float64)
    hidden, n = w64.shape
    if sx is not None and sx.shape != (hidden, hidden):
        raise ValueError(f"sx has shape {tuple(sx.shape)}, expected {(hidden, hidden)}")
    if t is not None and t.shape != (n, n):
        raise ValueError(f"t has shape {tuple(t.shape)}, expected {(n, n)}")
    lt = None if sx is None else _cholesky(sx.to(torch.float64)).T  # L^T
    z = w64 if lt is None else lt @ w64
    if t is not None:
        z = z @ _sym_sqrt(t.to(torch.float64))
    u, s, _ = torch.linalg.svd(z, full_matrices=False)
    a = u if lt is None else torch.linalg.solve_triangular(lt, u, upper=True)
    b = u.T @ (w64 if lt is None else lt @ w64)
    return GroupBasis(a=a.float(), b=b.float(), energy=(s**2).float())


def pca_basis(m: torch.Tensor, w: torch.Tensor) -> GroupBasis:
    """Output-space PCA basis: ``B`` = top eigenvectors of ``m`` (rows),
    ``A = w @ B^T`` (see ``eigen`` / ``post_rope`` in the module docstring).

    Args:
        m: ``[n, n]`` PSD second moment in the output space.
        w: ``[hidden, n]`` projection.

    Returns:
        Basis with ``energy`` the eigenvalues (descending).
    """
    evals, evecs = torch.linalg.eigh(m.to(torch.float64))
    order = torch.argsort(evals, descending=True)
    v = evecs[:, order]  # [n, n], columns = components
    a = w.detach().to(torch.float64) @ v
    return GroupBasis(a=a.float(), b=v.T.contiguous().float(),
                      energy=evals[order].clamp_min(0).float())


def factors_for_rank(
    basis: GroupBasis, rank: int, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [hidden, rank], B [rank, n])`` float32.

    At full rank (``rank == n``) this is the identity basis ``(w, I)``, so the
    cached latent equals the key or value exactly.

    Args:
        basis: Ordered basis of the group.
        rank: Kept components.
        w: ``[hidden, n]`` the group's original projection.

    Raises:
        ValueError: ``rank`` outside ``1..n``.
    """
    n = basis.full_width
    if not 1 <= rank <= n:
        raise ValueError(f"rank {rank} outside 1..{n}")
    if rank == n:
        return w.detach().float().clone(), torch.eye(n, dtype=torch.float32)
    if rank > basis.a.shape[1]:
        raise ValueError(f"rank {rank} exceeds the basis size {basis.a.shape[1]}")
    return basis.a[:, :rank].contiguous(), basis.b[:rank].contiguous()


def _complex_block(m: torch.Tensor, re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    """``(M_aa + M_bb) + i (M_ba - M_ab)`` of the real/imaginary index sets
    ``re``/``im`` of one RoPE frequency (``a``: real parts, ``b``: imaginary):
    for a second moment ``E[e e^T]`` this is ``E[z z^H]`` of ``z = a + i b``; for a
    metric ``T`` it is twice the Hermitian ``N`` with ``E_phi[e^T T e] = eps^H N
    eps`` averaged over rotations ``eps -> e^{i phi} eps``."""
    aa, bb = m[re][:, re], m[im][:, im]
    ab, ba = m[re][:, im], m[im][:, re]
    return torch.complex(aa + bb, ba - ab)


def rope_pairs(head_dim: int, num_heads: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(re, im)`` ``[head_dim/2, num_heads]`` int64 indices into a group's
    ``num_heads * head_dim`` key channels: frequency ``f`` of head ``j`` is the
    complex number ``k[re[f, j]] + i k[im[f, j]]`` that RoPE multiplies by
    ``e^{i theta_f t}`` (neox: dims ``f`` and ``f + d/2``; gptj: ``2f`` and ``2f + 1``)."""
    f = torch.arange(head_dim // 2)
    base = torch.arange(num_heads) * head_dim
    lo, hi = (f, f + head_dim // 2) if neox else (2 * f, 2 * f + 1)
    return lo[:, None] + base[None, :], hi[:, None] + base[None, :]


def rope_equivariant_basis(
    w: torch.Tensor,
    sx: torch.Tensor | None,
    t: torch.Tensor | None,
    *,
    head_dim: int,
    neox: bool = True,
) -> GroupBasis:
    """Key basis whose up-projection commutes with RoPE (``rope_equivariant``).

    Per RoPE frequency ``f`` the group's keys form ``z_f = a + i b`` in
    ``C^G`` (:func:`rope_pairs`); RoPE multiplies every head's ``z_f`` by the
    same ``e^{i theta_f t}``, so any complex-linear ``z_f -> z_f^`` of rank
    ``m_f`` commutes with it. With ``N_f`` the rotation-averaged metric and
    ``H_f = E[z_f z_f^H]`` (both from :func:`_complex_block`), ``N_f = L L^H``
    and the top eigenvectors ``U`` of ``L^H H_f L``, the optimum of objective
    (1) among such maps is ``z_f^ = L^{-H} U U^H L^H z_f`` (Eckart-Young in the
    metric ``N_f``), removing the eigenvalue ``lambda`` per component. Each
    complex component becomes two consecutive real latent channels
    ``(Re c, Im c)``; components of all frequencies are ordered by ``lambda``,
    so a truncation to an even rank keeps whole pairs and the up-projection
    satisfies ``R_t B^T = B^T R~_t`` (``R~_t`` rotates the pair of frequency
    ``f`` by ``theta_f t``; :func:`latent_frequencies`).

    Args:
        w: ``[hidden, n]`` key projection of the group (``n = G * head_dim``).
        sx: ``[hidden, hidden]`` input second moment; ``None``: identity.
        t: ``[n, n]`` PSD metric of key errors (the Fisher ``gk`` block);
            ``None``: identity.
        head_dim: Per-head width ``d``; RoPE must rotate all of it.
        neox: RoPE pair layout.

    Returns:
        ``GroupBasis`` with ``a = w @ D`` (``D`` the output-space down-projection),
        ``b`` ``[n, n]`` and ``energy`` (``lambda / 2`` per channel, descending
        by pair).

    Raises:
        ValueError: ``n`` is not a multiple of ``head_dim``, or shapes disagree.
    """
    w64 = w.detach().to(torch.float64)
    hidden, n = w64.shape
    if n % head_dim or head_dim % 2:
        raise ValueError(f"group width {n} is not a multiple of an even head_dim {head_dim}")
    cov = w64.T @ (w64 if sx is None else sx.to(torch.float64) @ w64)
    metric = (torch.eye(n, dtype=torch.float64, device=w64.device) if t is None
              else t.to(torch.float64))
    re, im = rope_pairs(head_dim, n // head_dim, neox)
    down = torch.zeros(n, n, dtype=torch.float64, device=w64.device)
    up = torch.zeros(n, n, dtype=torch.float64, device=w64.device)
    comps = []  # (lambda, frequency, alpha, beta)
    for f in range(head_dim // 2):
        h = _complex_block(cov, re[f], im[f])
        nrm = _complex_block(metric, re[f], im[f]) / 2
        mu, v = torch.linalg.eigh(nrm)
        mu = mu.clamp_min(mu.max().clamp_min(1e-30) * 1e-10)
        ell = v * mu.sqrt().to(v.dtype)  # N = L L^H
        ell_inv_h = v * mu.rsqrt().to(v.dtype)  # L^{-H}
        lam, u = torch.linalg.eigh(ell.mH @ h @ ell)
        for i in range(lam.numel()):
            comps.append((float(lam[i].clamp_min(0)), f, ell @ u[:, i], ell_inv_h @ u[:, i]))
    comps.sort(key=lambda c: -c[0])
    energy = torch.zeros(n, dtype=torch.float64)
    for k, (lam, f, alpha, beta) in enumerate(comps):
        r0, r1 = re[f].to(w64.device), im[f].to(w64.device)
        # c = alpha^H z: Re c = Re(alpha).a + Im(alpha).b, Im c = Re(alpha).b - Im(alpha).a
        down[r0, 2 * k], down[r1, 2 * k] = alpha.real, alpha.imag
        down[r0, 2 * k + 1], down[r1, 2 * k + 1] = -alpha.imag, alpha.real
        # z^ += beta c: a += Re(b) Re c - Im(b) Im c, b += Im(b) Re c + Re(b) Im c
        up[2 * k, r0], up[2 * k, r1] = beta.real, beta.imag
        up[2 * k + 1, r0], up[2 * k + 1, r1] = -beta.imag, beta.real
        energy[2 * k] = energy[2 * k + 1] = lam / 2
    return GroupBasis(a=(w64 @ down).float(), b=up.float(), energy=energy.float())


def latent_frequencies(basis_b: torch.Tensor, head_dim: int, neox: bool = True) -> torch.Tensor:
    """RoPE frequency index of each latent pair of a ``rope_equivariant`` basis.

    Args:
        basis_b: ``[r, n]`` up-projection (``r`` even), rows in pairs
            ``(Re c, Im c)``.
        head_dim: Per-head width.
        neox: RoPE pair layout.

    Returns:
        ``[r / 2]`` int64: pair ``l`` is rotated by ``theta_f t`` with ``f`` the
        returned index.

    Raises:
        ValueError: a pair has weight on more than one frequency (not such a basis).
    """
    r, n = basis_b.shape
    re, im = rope_pairs(head_dim, n // head_dim, neox)
    mass = basis_b.abs().double()
    per_f = torch.stack([mass[:, re[f]].sum(1) + mass[:, im[f]].sum(1)
                         for f in range(head_dim // 2)], dim=1)  # [r, d/2]
    pair = per_f[0::2] + per_f[1::2]
    freq = pair.argmax(1)
    off = pair.sum(1) - pair.gather(1, freq[:, None])[:, 0]
    if r % 2 or bool((off > 1e-5 * pair.sum(1).clamp_min(1e-30)).any()):
        raise ValueError("the up-projection is not complex-linear per RoPE frequency")
    return freq


def rotate_half_matrix(dim: int, neox: bool, device: torch.device | str = "cpu"
                       ) -> torch.Tensor:
    """``P`` with ``P @ x = rotate_half(x)`` (neox: ``[-x2, x1]``; gptj:
    interleaved pairs ``(-x_{2i+1}, x_{2i})``), float64 ``[dim, dim]`` on ``device``."""
    p = torch.zeros(dim, dim, dtype=torch.float64, device=device)
    half = dim // 2
    for i in range(half):
        if neox:
            lo, hi = i, i + half
        else:
            lo, hi = 2 * i, 2 * i + 1
        p[lo, hi] = -1.0
        p[hi, lo] = 1.0
    return p


def rope_tables(length: int, inv_freq: torch.Tensor, dim: int, neox: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE as ``R_t = diag(c_t) + diag(s_t) P`` for positions ``t = 0..length-1``.

    Args:
        length: Positions.
        inv_freq: ``[rot/2]`` inverse frequencies (radians per position).
        dim: Head width ``d >= rot``; dimensions past ``rot`` are not rotated.
        neox: neox (half split) or gptj (interleaved) pair layout.

    Returns:
        ``(c [length, d], s [length, d], P [d, d])`` float64 on ``inv_freq``'s
        device: cosines (1 past ``rot``), sines (0 past ``rot``) and the
        rotate-half matrix (:func:`rotate_half_matrix` on the first ``rot``
        dimensions).
    """
    rot = 2 * inv_freq.numel()
    dev = inv_freq.device
    ang = (torch.arange(length, dtype=torch.float64, device=dev)[:, None]
           * inv_freq.to(torch.float64)[None, :])
    ang = torch.cat([ang, ang], dim=1) if neox else ang.repeat_interleave(2, dim=1)
    c = torch.ones(length, dim, dtype=torch.float64, device=dev)
    s = torch.zeros(length, dim, dtype=torch.float64, device=dev)
    c[:, :rot] = ang.cos()
    s[:, :rot] = ang.sin()
    p = torch.zeros(dim, dim, dtype=torch.float64, device=dev)
    p[:rot, :rot] = rotate_half_matrix(rot, neox, dev)
    return c, s, p


def rope_query_metric(
    sigma_q: torch.Tensor,
    inv_freq: torch.Tensor,
    distance_weights: torch.Tensor,
    neox: bool = True,
) -> torch.Tensor:
    """``E_delta[R_delta Sigma_q R_delta^T]``: the metric of key errors seen
    through RoPE'd scores (module docstring, keys of ``kq``).

    With ``R = diag(c) + diag(s) P`` (``c, s`` the cos/sin of each dimension's
    angle ``delta * inv_freq``, ``P`` the rotate-half matrix):

        E[R S R^T] = S*E[c c^T] + (S P^T)*E[c s^T] + (P S)*E[s c^T] + (P S P^T)*E[s s^T]

    with ``*`` elementwise; dimensions past ``2 * len(inv_freq)`` are not rotated.

    Args:
        sigma_q: ``[d, d]`` pre-RoPE query second moment (sum over the heads).
        inv_freq: ``[rot/2]`` RoPE inverse frequencies (radians per position).
        distance_weights: ``[L]`` non-negative weight of query-key distance
            ``delta = 0..L-1`` (normalised here).
        neox: neox (half split) or gptj (interleaved) pair layout.

    Returns:
        ``[d, d]`` float64 PSD metric.
    """
    w = distance_weights.to(torch.float64)
    w = w / w.sum().clamp_min(1e-30)
    c, s, p = rope_tables(w.numel(), inv_freq, sigma_q.shape[0], neox)  # delta = 0..L-1
    sq = sigma_q.to(torch.float64)
    cw, sw = c * w[:, None], s * w[:, None]
    ecc, ecs, ess = cw.T @ c, cw.T @ s, sw.T @ s
    out = sq * ecc + (sq @ p.T) * ecs + (p @ sq) * ecs.T + (p @ sq @ p.T) * ess
    return 0.5 * (out + out.T)


def value_output_metric(w_o_heads: list[torch.Tensor]) -> torch.Tensor:
    """``sum_i W_O^{(i)} W_O^{(i)T}`` over the query heads reading one value head.

    Args:
        w_o_heads: ``[head_dim, hidden]`` slices of ``o_proj`` (as ``y = o @ W``),
            one per query head that reads this KV head.

    Returns:
        ``[head_dim, head_dim]`` float64 PSD metric.
    """
    return sum(w.to(torch.float64) @ w.to(torch.float64).T for w in w_o_heads)

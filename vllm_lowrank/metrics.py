"""Prometheus metrics of the latent KV cache, served on vLLM's own ``/metrics``.

vLLM runs the API server, the engine core and the workers in separate
processes; the values must be the ones in force in the worker, so they travel
through a small state directory:

1. Front end (:func:`install`, called by ``plugin.register()``): in a top-level
   process (not a ``multiprocessing`` child) it picks a fresh, private state
   directory, exports its path as :data:`STATE_DIR_ENV` *before* vLLM spawns
   the engine processes (children inherit the environment; a value inherited
   from another top-level process is replaced), and registers
   :class:`LowRankCollector` on ``prometheus_client.REGISTRY``, the registry
   vLLM serves at ``/metrics`` with one API server.
2. Worker (:func:`publish`, one call in the model's constructor once the
   compression plan is resolved): writes
   ``ModelCompression.summary(dtype_bytes)`` of its shard as JSON, atomically,
   to ``worker-dp<d>-pp<p>-tp<t>.json`` in that directory.
3. Scrape: the collector reads the state files, and the KV token capacity vLLM
   allocated from vLLM's own ``vllm:cache_config_info`` (the front end learns
   ``num_gpu_blocks`` and ``kv_cache_size_tokens`` from the engine at start-up).

Metrics (all gauges):

- ``vllm_lowrank_compression_enabled``: 1 when the workers run the latent
  cache, else 0.
- ``vllm_lowrank_configured_rank_fraction``: the ``rank_fraction`` setting
  (fraction of the K+V width kept; ``vllm_lowrank_configured_ratio`` before).
- ``vllm_lowrank_kv_compression_ratio``: achieved, original KV bytes per token
  / stored bytes per token of the latent cache.
- ``vllm_lowrank_sequence_compression_ratio``: the same for a whole sequence of
  ``max_model_len`` tokens, the token-adaptive mode's exact tokens included
  (its sink and recent tokens are held at full size besides their latents):
  what the number of sequences a cache holds scales by. Equal to
  ``kv_compression_ratio`` without the token-adaptive mode.
- ``vllm_lowrank_original_bytes_per_token``, ``vllm_lowrank_stored_bytes_per_token``:
  bytes per token of all layers' K and V, without compression and as cached.
- ``vllm_lowrank_layer_rank{layer, side[, group]}``: latent width (elements per
  token) of a layer's keys (``side="k"``) or values (``side="v"``); labelled per
  head group (global index) when a layer has several groups.
- ``vllm_lowrank_info{method, artifact}``: 1; what made the factors
  (``method``: ``identity`` at full rank, where no factorization is done; the
  artifact's method; or ``svd``, weight SVD without calibration) and which
  artifact (``artifact``: its manifest digest ``blake2b:<hex>``, or ``none``;
  never its path, as ``/metrics`` is unauthenticated).
- ``vllm_lowrank_decode_layers{path}``: latent attention layers (of the first
  tensor-parallel shard) whose decode runs on ``path`` (the name of its decoder:
  ``cuda``, ``triton-grid``, ``token-adaptive+triton-latent-rope``, ...,
  ``torch``; :mod:`vllm_lowrank.attention.decoders`), once chosen: at
  start-up on a GPU, at the first decode step on a CPU.
- ``vllm_lowrank_kv_cache_capacity_tokens{engine}``: KV cache tokens vLLM
  allocated (with or without compression), the figure vLLM logs as "KV cache
  size: N tokens" (``kv_cache_size_tokens``: max concurrency x max_model_len,
  equal to blocks x block size when max_model_len is a multiple of the block
  size); absent with ``--disable-log-stats`` (vLLM then has no
  ``vllm:cache_config_info``).

With compression off only ``vllm_lowrank_compression_enabled 0`` and the
capacity are exported. Limitations: with ``--api-server-count > 1`` vLLM serves
a multiprocess registry and these metrics are not exported (logged once); the
state directory is local, so workers must run on the API server's node and be
``multiprocessing`` children of it (vLLM's default ``mp`` executor, not Ray).
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger("vllm.lowrank")

STATE_DIR_ENV = "VLLM_LOWRANK_METRICS_DIR"
"""Environment variable holding the state directory (set by :func:`install`)."""
PREFIX = "vllm_lowrank_"
_DIR_PREFIX = "vllm-lowrank-metrics-"
_CACHE_INFO = "vllm:cache_config_info"

_installed = False
_lock = threading.Lock()


def _is_top_level_process() -> bool:
    """True outside ``multiprocessing`` children (engine core, workers, extra
    API servers are children; ``vllm serve`` itself is not)."""
    return multiprocessing.parent_process() is None


def install() -> str | None:
    """Front-end half: export a fresh state directory and register the collector.

    Idempotent; does nothing in ``multiprocessing`` children (they use the
    directory inherited from their top-level process).

    Returns:
        The state directory path, or ``None`` in a child process.
    """
    global _installed
    if not _is_top_level_process():
        return None
    with _lock:
        if _installed:
            return os.environ[STATE_DIR_ENV]
        remove_stale_state_dirs(tempfile.gettempdir())
        path = os.path.join(tempfile.gettempdir(),
                            f"{_DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.environ[STATE_DIR_ENV] = path
        owner = os.getpid()
        atexit.register(_cleanup, path, owner)
        from prometheus_client import REGISTRY

        REGISTRY.register(LowRankCollector(path))
        _installed = True
        return path


def remove_stale_state_dirs(root: str) -> list[str]:
    """Remove the state directories under ``root`` of front-end processes that
    are gone (killed before their exit handler ran), owned by this user.

    A directory is named ``vllm-lowrank-metrics-<pid>-<random>``; it is stale
    when no process ``<pid>`` exists. A live process with a reused pid keeps
    an old directory until it exits (its handler removes only its own).

    Returns:
        The directories removed.
    """
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_DIR_PREFIX):
            continue
        pid = name[len(_DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            if not pid.isdigit() or os.lstat(path).st_uid != os.getuid() or _alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("vllm-lowrank: removed %d metrics state folder(s) of ended processes",
                    len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _cleanup(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _dtype_bytes(model) -> int:
    """Bytes per cached element: the KV cache dtype of the model's attention
    layers (vLLM sets ``kv_cache_torch_dtype``), else the parameter dtype."""
    for m in model.modules():
        dtype = getattr(m, "kv_cache_torch_dtype", None)
        if dtype is not None:
            return dtype.itemsize
    return next(model.parameters()).dtype.itemsize


def _parallel_ranks() -> dict[str, int]:
    """This worker's data/pipeline/tensor parallel ranks (0 when unset)."""
    ranks = {"dp": 0, "pp": 0, "tp": 0}
    try:
        from vllm.distributed import parallel_state as ps

        ranks["tp"] = ps.get_tp_group().rank_in_group
        ranks["pp"] = ps.get_pp_group().rank_in_group
    except (AssertionError, AttributeError, ImportError):
        pass
    try:
        from vllm.config.vllm import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None:
            ranks["dp"] = int(config.parallel_config.data_parallel_rank or 0)
    except (AttributeError, ImportError):
        pass
    return ranks


def publish(model, max_model_len: int) -> str | None:
    """Worker half: write what is in force in this worker to the state directory.

    Args:
        model: A model whose ``_lowrank`` is the resolved
            :class:`~vllm_lowrank.models.compression.ModelCompression` (its
            attention layers built, so their KV cache dtype and exact slots
            are known).
        max_model_len: Tokens of the longest sequence (the context over which
            the exact tokens are counted).

    Returns:
        The file written, or ``None`` when no state directory is exported (the
        plugin was not registered in a top-level process) or writing failed
        (logged; serving never fails because of metrics).
    """
    directory = os.environ.get(STATE_DIR_ENV)
    compression = getattr(model, "_lowrank", None)
    if not directory or compression is None:
        return None
    ranks = _parallel_ranks()
    state = compression.summary(_dtype_bytes(model))
    exact = [m.exact for m in model.modules() if getattr(m, "exact", None) is not None]
    state.update(pid=os.getpid(), parallel=ranks, max_model_len=max_model_len,
                 exact_bytes_per_token=sum(e.slot.slot_bytes for e in exact),
                 exact_tokens_per_sequence=max((e.sink + e.recent + 1 for e in exact),
                                               default=0),
                 groups_per_layer={str(i): p.num_groups
                                   for i, p in compression.plans.items()})
    path = os.path.join(directory, f"worker-dp{ranks['dp']}-pp{ranks['pp']}-tp{ranks['tp']}.json")
    state["decode_paths"] = dict(_WORKER["decode_paths"])
    if not _write_state(directory, path, state):
        return None
    _WORKER.update(path=path, directory=directory, state=state)
    return path


_WORKER: dict[str, Any] = {"decode_paths": {}}
"""This worker's published state (``path``, ``directory``, ``state``) and the
decode path of each latent layer chosen so far (``decode_paths``)."""


def _write_state(directory: str, path: str, state: dict[str, Any]) -> bool:
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".state-", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("vllm-lowrank: cannot write metrics state to %s (%s); "
                       "vllm_lowrank_* metrics will show compression disabled", path, e)
        return False
    return True


def record_decode_path(layer_name: str, path: str) -> None:
    """Worker half: the decode path (``cuda``, ``triton``, ``torch``) chosen for
    the latent attention layer ``layer_name``, added to this worker's published
    state (rewritten, atomically; nothing is written before :func:`publish`)."""
    _WORKER["decode_paths"][layer_name] = path
    if "path" in _WORKER:
        _WORKER["state"]["decode_paths"] = dict(_WORKER["decode_paths"])
        _write_state(_WORKER["directory"], _WORKER["path"], _WORKER["state"])


def read_states(directory: str) -> list[dict[str, Any]]:
    """The worker states in ``directory`` of the lowest data-parallel rank
    (every DP engine serves the same plan); unreadable files are skipped."""
    states = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if not (name.startswith("worker-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                states.append(json.load(f))
        except (OSError, ValueError) as e:
            logger.warning("vllm-lowrank: skipping unreadable metrics state %s (%s)", name, e)
    if not states:
        return []
    dp = min(s["parallel"]["dp"] for s in states)
    return [s for s in states if s["parallel"]["dp"] == dp]


def aggregate(states: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Combine the workers of one engine (tensor/pipeline shards) into one view.

    Returns:
        ``None`` when no worker runs compression, else ``configured_rank_fraction``,
        ``method``, ``artifact``, ``original_bytes_per_token`` and
        ``stored_bytes_per_token`` (summed over shards: bytes per token of the
        whole engine), ``compression_ratio``, ``sequence_compression_ratio``
        (a ``max_model_len`` sequence, exact tokens included: ``sink + recent +
        1`` of them at the exact slot size) and ``ranks``: ``{(layer, side,
        group): rank}`` with global group indices (``tp_rank * local_groups +
        g``) and ``grouped``, whether any layer has more than one group overall.
    """
    states = [s for s in states if s.get("enabled")]
    if not states:
        return None
    original = sum(s["original_bytes_per_token"] for s in states)
    stored = sum(s["stored_bytes_per_token"] for s in states)
    length = states[0].get("max_model_len") or 1
    exact = sum(s.get("exact_bytes_per_token", 0)
                * min(s.get("exact_tokens_per_sequence", 0), length) for s in states)
    ranks: dict[tuple[int, str, int], int] = {}
    tp_size = 1 + max(s["parallel"]["tp"] for s in states)
    grouped = False
    for s in states:
        for layer, entry in s["layers"].items():
            local = len(entry["k_ranks"])
            grouped |= local * tp_size > 1
            for side in ("k", "v"):
                for g, r in enumerate(entry[f"{side}_ranks"]):
                    ranks[(int(layer), side, s["parallel"]["tp"] * local + g)] = int(r)
    first = min(states, key=lambda s: (s["parallel"]["pp"], s["parallel"]["tp"]))
    paths: dict[str, int] = {}
    for s in states:
        if s["parallel"]["tp"] == first["parallel"]["tp"]:  # every pipeline stage once
            for name in s.get("decode_paths", {}).values():
                paths[name] = paths.get(name, 0) + 1
    return {
        "decode_layers": paths,
        "configured_rank_fraction": first["configured_rank_fraction"],
        "method": first["method"],
        "artifact": first["artifact"],
        "original_bytes_per_token": original,
        "stored_bytes_per_token": stored,
        "compression_ratio": original / stored,
        "sequence_compression_ratio": original * length / (stored * length + exact),
        "ranks": ranks,
        "grouped": grouped,
    }


class LowRankCollector:
    """``prometheus_client`` collector exporting the ``vllm_lowrank_*`` gauges
    at scrape time (see the module docstring).

    Args:
        directory: State directory the workers write to.
        registry: Where to find vLLM's ``vllm:cache_config_info`` (default:
            the global registry).
    """

    def __init__(self, directory: str, registry=None) -> None:
        self.directory = directory
        self._registry = registry
        self._in_collect = threading.local()
        self._warned = False

    def describe(self) -> Iterable:
        """The metric names (so the registry never collects us to learn them)."""
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(PREFIX + n, "") for n in (
            "compression_enabled", "configured_rank_fraction", "kv_compression_ratio",
            "sequence_compression_ratio",
            "original_bytes_per_token", "stored_bytes_per_token", "layer_rank", "info",
            "decode_layers", "kv_cache_capacity_tokens")]

    def collect(self) -> Iterator:
        """Yield the gauges; never raises (a broken state file is skipped)."""
        if getattr(self._in_collect, "active", False):  # re-entered via the registry
            return
        self._in_collect.active = True
        try:
            yield from self._collect()
        finally:
            self._in_collect.active = False

    def _collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not self._warned:
            self._warned = True
            logger.warning("vllm-lowrank: PROMETHEUS_MULTIPROC_DIR is set (api_server_count "
                           "> 1?); vLLM serves a multiprocess registry there and the "
                           "vllm_lowrank_* metrics are not exported")
        view = aggregate(read_states(self.directory))
        yield GaugeMetricFamily(
            PREFIX + "compression_enabled",
            "1 when the workers run the latent (low-rank) KV cache, else 0",
            value=0 if view is None else 1)
        if view is not None:
            yield GaugeMetricFamily(
                PREFIX + "configured_rank_fraction",
                "Configured fraction of the K+V cache width kept (rank_fraction setting)",
                value=view["configured_rank_fraction"])
            yield GaugeMetricFamily(
                PREFIX + "kv_compression_ratio",
                "Achieved KV compression: original KV bytes / stored bytes per token "
                "of the latent cache",
                value=view["compression_ratio"])
            yield GaugeMetricFamily(
                PREFIX + "sequence_compression_ratio",
                "Original KV bytes / stored bytes of a max_model_len sequence, the "
                "token-adaptive mode's exact sink and recent tokens included",
                value=view["sequence_compression_ratio"])
            yield GaugeMetricFamily(
                PREFIX + "original_bytes_per_token",
                "KV cache bytes per token without compression (all layers, K and V)",
                value=view["original_bytes_per_token"])
            yield GaugeMetricFamily(
                PREFIX + "stored_bytes_per_token",
                "KV cache bytes per token actually stored (latents of all layers)",
                value=view["stored_bytes_per_token"])
            labels = ["layer", "side"] + (["group"] if view["grouped"] else [])
            ranks = GaugeMetricFamily(
                PREFIX + "layer_rank",
                "Latent width (rank) cached per token for a layer's keys (side=k) or "
                "values (side=v), per head group when a layer has several",
                labels=labels)
            for (layer, side, group), r in sorted(view["ranks"].items()):
                values = [str(layer), side] + ([str(group)] if view["grouped"] else [])
                ranks.add_metric(values, r)
            yield ranks
            info = GaugeMetricFamily(PREFIX + "info",
                                     "What made the factors (method: identity at full "
                                     "rank, the artifact's method, or svd) and the "
                                     "artifact's manifest digest (always 1)",
                                     labels=["method", "artifact"])
            info.add_metric([str(view["method"]), str(view["artifact"])], 1)
            yield info
            if view["decode_layers"]:
                fam = GaugeMetricFamily(
                    PREFIX + "decode_layers",
                    "Latent attention layers whose decode runs on a path (cuda: the "
                    "CUDA kernel, triton: the Triton kernels, torch: the torch path)",
                    labels=["path"])
                for name, count in sorted(view["decode_layers"].items()):
                    fam.add_metric([name], count)
                yield fam
        capacity = self._capacity()
        if capacity:
            fam = GaugeMetricFamily(
                PREFIX + "kv_cache_capacity_tokens",
                "KV cache capacity vLLM allocated, in tokens (per engine)",
                labels=["engine"])
            for engine, tokens in sorted(capacity.items()):
                fam.add_metric([engine], tokens)
            yield fam

    def _capacity(self) -> dict[str, int]:
        """``{engine: tokens}`` from vLLM's ``vllm:cache_config_info`` labels
        (``kv_cache_size_tokens``, else ``num_gpu_blocks * block_size``); empty
        before the engine reported its cache."""
        from prometheus_client import REGISTRY

        registry = self._registry or REGISTRY
        out: dict[str, int] = {}
        try:
            for metric in registry.restricted_registry([_CACHE_INFO]).collect():
                for sample in metric.samples:
                    labels = sample.labels
                    tokens = _int(labels.get("kv_cache_size_tokens"))
                    if tokens is None:
                        blocks = _int(labels.get("num_gpu_blocks"))
                        size = _int(labels.get("block_size"))
                        tokens = blocks * size if blocks and size else None
                    if tokens:
                        out[labels.get("engine", "0")] = tokens
        except Exception as e:  # a scrape must not fail because of us
            logger.debug("vllm-lowrank: no KV capacity for metrics (%s)", e)
        return out


def kv_capacity_tokens(cache_config) -> int:
    """Tokens an engine's KV cache holds, from its (front-end) ``CacheConfig``:
    vLLM's group-aware ``kv_cache_size_tokens`` (what it logs as "KV cache
    size"), else ``num_gpu_blocks * block_size``.

    The block count alone is not comparable across models or settings with
    several KV cache groups (hybrid sliding/full attention): one block then
    holds one page of one group's layers, and the number of groups changes with
    the layer specs.
    """
    tokens = getattr(cache_config, "kv_cache_size_tokens", None)
    if tokens:
        return int(tokens)
    return int(cache_config.num_gpu_blocks * cache_config.block_size)


def _int(text) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None

"""The plugin's patches of vLLM's command line, in one place (the only other
patch substitutes vLLM's attention class while a model is constructed:
:func:`vllm_lowrank.models.causal_lm.substitute`).

vLLM 0.32 has no hook for a plugin-owned CLI flag (``--kv-cache-dtype`` is a
``Literal``). Three ``EngineArgs`` methods are wrapped, each declared below with
its target; :func:`apply` refuses to patch twice and logs what it replaced.

- ``EngineArgs.add_cli_args``: adds the ``KVCompression`` argument group
  (``--kv-compression``, ``--kv-compression-config``), shown by
  ``vllm serve --help`` and ``--help=KVCompression``.
- ``EngineArgs.from_cli_args``: merges the two flags into
  ``additional_config["kv_compression"]`` *after* parsing, so a later or earlier
  ``--additional-config`` on the same command line cannot overwrite them.
- ``EngineArgs.create_engine_config``: validates the settings against the model
  (architecture, head counts, ranks) in the front-end process, before any engine
  process starts; gives a preset its measured KV block size, and a
  byte-budget allocation artifact the block size it was allocated for
  (:func:`~vllm_lowrank.calibration.allocate.allocated_block_size`), when
  ``--block-size`` is not set, and the token-adaptive mode a per-request
  prefill chunk (:func:`~vllm_lowrank.format.exact.prefill_chunk_tokens`) when
  ``--long-prefill-token-threshold`` is not set, and an admission watermark
  (the config's ``admission_watermark``, by default
  :data:`~vllm_lowrank.format.exact.PREEMPTION_WATERMARK`) when ``--watermark``
  is not. From the CLI a problem is one line on stderr and exit code 2;
  from Python it is a :class:`~vllm_lowrank.config.LowRankConfigError`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from typing import Any

from vllm_lowrank import compat
from vllm_lowrank.config import (
    ADDITIONAL_CONFIG_KEY,
    MODES,
    LowRankConfig,
    LowRankConfigError,
    config_from_additional,
    keys_help,
    parse_config_text,
)
from vllm_lowrank.format.exact import PREEMPTION_WATERMARK, prefill_chunk_tokens
from vllm_lowrank.presets import get_preset

logger = logging.getLogger("vllm.lowrank")

_PATCHED_MARK = "__vllm_lowrank_patched__"
_CLI_MARK = "_vllm_lowrank_from_cli"
GROUP_TITLE = "KVCompression"
GROUP_DESCRIPTION = (
    "Latent (low-rank) KV cache of vllm-lowrank: --kv-compression {none,lowrank} "
    "and --kv-compression-config JSON.\n"
    "The KV cache stores a rank-r latent per token instead of full keys and "
    "values; see the vllm-lowrank README for every setting."
)
CONFIG_HELP = ("Settings of the latent cache, inline JSON or a path to a JSON file. "
               "Keys: " + keys_help() + ".")


def _fail(message: str) -> None:
    """Print a one-line CLI error and exit with status 2 (argparse's code)."""
    print(f"vllm-lowrank: error: {message}", file=sys.stderr)
    sys.exit(2)


class _ModeAction(argparse.Action):
    """``--kv-compression``: validated here so a bad value is one line, not
    vLLM's full usage text."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values not in MODES:
            _fail(
                f"--kv-compression {values!r} is not supported; choose one of "
                f"{', '.join(MODES)}"
            )
        setattr(namespace, self.dest, values)


class _ConfigAction(argparse.Action):
    """``--kv-compression-config``: parsed and field-checked at parse time."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            raw = parse_config_text(values)
            LowRankConfig.from_dict({"mode": "lowrank", **raw})
        except LowRankConfigError as e:
            _fail(str(e))
        setattr(namespace, self.dest, raw)


def _add_cli_args(original, parser):
    parser = original(parser)
    if GROUP_TITLE in compat.argument_group_titles(parser):
        return parser
    group = parser.add_argument_group(title=GROUP_TITLE, description=GROUP_DESCRIPTION)
    group.add_argument(
        "--kv-compression",
        action=_ModeAction,
        default=None,
        metavar="{none,lowrank}",
        help="KV cache compression: 'none' (stock vLLM) or 'lowrank' (latent KV "
        "cache, several times more cacheable tokens per GiB).",
    )
    group.add_argument(
        "--kv-compression-config",
        action=_ConfigAction,
        default=None,
        metavar="JSON|PATH",
        help=CONFIG_HELP,
    )
    return parser


def merge_cli_settings(
    additional_config: dict[str, Any] | None,
    mode: str | None,
    config: dict[str, Any] | None,
) -> dict[str, Any]:
    """``additional_config`` with the two flags merged under
    :data:`ADDITIONAL_CONFIG_KEY` (flags win over an ``--additional-config``
    entry of the same key).

    Raises:
        LowRankConfigError: settings given without ``--kv-compression lowrank``,
            or invalid as a whole.
    """
    merged = dict(additional_config or {})
    if mode is None and config is None:
        return merged
    if config is not None and mode != "lowrank":
        raise LowRankConfigError(
            "--kv-compression-config was given without --kv-compression lowrank; "
            "add --kv-compression lowrank"
        )
    entry = merged.get(ADDITIONAL_CONFIG_KEY)
    entry = {"mode": entry} if isinstance(entry, str) else dict(entry or {})
    entry.update(config or {})
    entry["mode"] = mode
    LowRankConfig.from_dict(entry)
    merged[ADDITIONAL_CONFIG_KEY] = entry
    return merged


def _from_cli_args(original, cls, args):
    engine_args = original(cls, args)
    try:
        engine_args.additional_config = merge_cli_settings(
            engine_args.additional_config,
            getattr(args, "kv_compression", None),
            getattr(args, "kv_compression_config", None),
        )
    except LowRankConfigError as e:
        _fail(str(e))
    setattr(engine_args, _CLI_MARK, True)
    return engine_args


def _create_engine_config(original, self, *args, **kwargs):
    try:
        cfg = config_from_additional(self.additional_config)
    except LowRankConfigError as e:
        return _report(self, e)
    chunk = prefill_chunk_tokens(cfg, self.max_model_len)
    if chunk and not self.long_prefill_token_threshold:
        self.long_prefill_token_threshold = chunk
        logger.info("vllm-lowrank: token-adaptive mode: prefill chunks of at most %d tokens "
                    "per request (long_prefill_token_threshold; bounds the exact blocks each "
                    "request holds; --long-prefill-token-threshold overrides)", chunk)
    if cfg.enabled and cfg.token_adaptive and not self.watermark:
        watermark = PREEMPTION_WATERMARK if cfg.admission_watermark is None \
            else cfg.admission_watermark
        if watermark:
            self.watermark = watermark
            logger.info("vllm-lowrank: token-adaptive mode: admission watermark %.2f (keeps "
                        "KV blocks free for running requests: a preempted request recomputes "
                        "in prefill chunks; a nonzero --watermark overrides, "
                        "\"admission_watermark\": 0 turns it off)", watermark)
    allocated = None
    if cfg.enabled:
        from vllm_lowrank.calibration.allocate import allocated_block_size, default_block_size

        size, source = default_block_size(cfg)
        # the manifest is read once unless a preset's size came first
        allocated = size if source == "artifact" else allocated_block_size(cfg.artifact)
        if self.block_size is None and size is not None:
            self.block_size = size
            if source == "preset":
                logger.info("vllm-lowrank: preset %s: KV block size %d (as measured; "
                            "--block-size overrides)", cfg.preset, size)
            else:
                logger.info("vllm-lowrank: artifact %s: KV block size %d, as it was "
                            "allocated for (--block-size overrides)", cfg.artifact, size)
    if allocated is not None and self.block_size != allocated:
        logger.warning("vllm-lowrank: artifact %s was allocated for KV blocks of %d tokens, "
                       "served with %d: its exact tokens round to other blocks, so the bytes "
                       "per token differ from its budget's (drop --block-size or allocate "
                       "again with it)", cfg.artifact, allocated, self.block_size)
    vllm_config = original(self, *args, **kwargs)
    if cfg.enabled:
        from vllm_lowrank.models.adapters import check_model

        try:
            check_model(vllm_config, cfg)
        except LowRankConfigError as e:
            return _report(self, e)
        if cfg.preset is not None:
            preset = get_preset(cfg.preset)
            logger.info("vllm-lowrank: preset %s, measured on SmolLM2-135M: %s; decode on "
                        "a CUDA device: %s", preset.name, preset.measured, preset.gpu_path)
        logger.info("vllm-lowrank: latent KV cache enabled with %s", cfg.to_dict())
    return vllm_config


def _report(engine_args, error: LowRankConfigError):
    if getattr(engine_args, _CLI_MARK, False):
        _fail(str(error))
    raise error


def _wrap(owner: type, name: str, wrapper, *, classmethod_: bool = False) -> None:
    current = owner.__dict__[name]
    if getattr(current, _PATCHED_MARK, False):
        raise RuntimeError(f"vllm-lowrank: {owner.__name__}.{name} is already patched")
    if classmethod_:
        original = current.__func__

        @functools.wraps(original)
        def patched(cls, *a, **kw):
            return wrapper(original, cls, *a, **kw)

        setattr(patched, _PATCHED_MARK, True)
        setattr(owner, name, classmethod(patched))
    elif isinstance(current, staticmethod):
        original = current.__func__

        @functools.wraps(original)
        def patched(*a, **kw):
            return wrapper(original, *a, **kw)

        setattr(patched, _PATCHED_MARK, True)
        setattr(owner, name, staticmethod(patched))
    else:
        original = current

        @functools.wraps(original)
        def patched(*a, **kw):
            return wrapper(original, *a, **kw)

        setattr(patched, _PATCHED_MARK, True)
        setattr(owner, name, patched)
    logger.debug("vllm-lowrank patched %s.%s", owner.__name__, name)


def is_applied() -> bool:
    """True when :func:`apply` has run in this process."""
    from vllm.engine.arg_utils import EngineArgs

    return getattr(EngineArgs.__dict__["add_cli_args"].__func__, _PATCHED_MARK, False)


def apply() -> None:
    """Install the three ``EngineArgs`` patches (idempotent per process)."""
    from vllm.engine.arg_utils import EngineArgs

    if is_applied():
        return
    _wrap(EngineArgs, "add_cli_args", _add_cli_args)
    _wrap(EngineArgs, "from_cli_args", _from_cli_args, classmethod_=True)
    _wrap(EngineArgs, "create_engine_config", _create_engine_config)

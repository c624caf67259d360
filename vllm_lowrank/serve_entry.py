"""``vllm-lowrank-serve``: ``vllm serve``, closed by default (the image's entry point).

It starts ``vllm serve ARGS`` only when vLLM's OpenAI API will require a key:
``--api-key`` among the arguments, ``VLLM_API_KEY`` set, or
``VLLM_API_KEY_FILE`` naming a file (a mounted Kubernetes Secret) whose
content, stripped, becomes ``VLLM_API_KEY`` (so the key appears neither in the
process list nor in the pod spec). Otherwise it refuses with one
``vllm-lowrank: error:`` line and exit code 2. ``VLLM_LOWRANK_ALLOW_NO_API_KEY=1``
opts out (a server on loopback only).

vLLM's key guards the API routes (``/v1``...); ``/health`` and ``/metrics`` stay
open for probes and the Prometheus scraper, so who reaches the port is limited
by the NetworkPolicy (``deploy/base/networkpolicy.yaml``), and ``/metrics``
carries nothing private (:mod:`vllm_lowrank.metrics`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from vllm_lowrank.config import LowRankConfigError

KEY_FILE_ENV = "VLLM_API_KEY_FILE"
KEY_ENV = "VLLM_API_KEY"
OPT_OUT_ENV = "VLLM_LOWRANK_ALLOW_NO_API_KEY"
MAX_KEY_BYTES = 4096


def serve_command(argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and environment to exec.

    Args:
        argv: Arguments after the program name (passed to ``vllm serve``).
        env: The current environment.

    Returns:
        ``(command, environment)``; the key file's content is in
        ``environment[VLLM_API_KEY]``.

    Raises:
        LowRankConfigError: no key anywhere (and no opt-out), or an unusable
            key file.
    """
    from vllm_lowrank.inputs import read_text

    env = dict(env)
    if env.get(KEY_FILE_ENV):
        key = read_text(env[KEY_FILE_ENV], f"{KEY_FILE_ENV} file", MAX_KEY_BYTES).strip()
        if not key:
            raise LowRankConfigError(f"{KEY_FILE_ENV} file {env[KEY_FILE_ENV]!r} is empty; put "
                                     "the API key in it (the Secret's value)")
        env[KEY_ENV] = key
    has_flag = any(a == "--api-key" or a.startswith("--api-key=") for a in argv)
    if not (has_flag or env.get(KEY_ENV) or env.get(OPT_OUT_ENV) == "1"):
        raise LowRankConfigError(
            f"no API key: the server would answer anyone who reaches its port; set "
            f"{KEY_FILE_ENV} (a mounted Secret), {KEY_ENV} or --api-key, or "
            f"{OPT_OUT_ENV}=1 for a server on loopback only")
    return ["vllm", "serve", *argv], env


def main(argv: Sequence[str] | None = None) -> None:
    """Replace this process by ``vllm serve`` (see the module docstring)."""
    try:
        command, env = serve_command(sys.argv[1:] if argv is None else argv, os.environ)
    except LowRankConfigError as e:
        print(f"vllm-lowrank: error: {e}", file=sys.stderr)
        sys.exit(2)
    os.execvpe(command[0], command, env)

"""``vllm-lowrank-serve``: ``vllm serve``, closed by default (the image's entry point).

The entry point decides the API keys itself, then replaces its process by the
``vllm serve`` of its own Python environment (``sys.executable -P -m
vllm.entrypoints.cli.main serve ARGS``: never a ``vllm`` found on ``PATH``).
The keys come from one source, in this order:

1. ``--api-key KEY [KEY ...]`` (also ``--api-key=KEY``, ``--api_key`` and
   argparse's abbreviations such as ``--api-k``);
2. ``VLLM_API_KEY_FILE`` naming a file (a mounted Kubernetes Secret) whose
   content, stripped, becomes ``VLLM_API_KEY`` (so the key appears neither in
   the process list nor in the pod spec);
3. ``VLLM_API_KEY``.

It refuses, with one ``vllm-lowrank: error:`` line and exit code 2: no key at
all, an empty or blank key (``--api-key ""`` or ``--api-key=`` would make vLLM
install no authentication at all), ``--api-key`` without a value, and a key
given both by flag and by ``VLLM_API_KEY_FILE``. ``VLLM_LOWRANK_ALLOW_NO_API_KEY=1``
permits starting without any key (a server on loopback only).

vLLM's own key check guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``: ``/invocations`` (a completion endpoint), ``/tokenize``,
``/scale_elastic_ep``, ``/docs`` and the rest stay open. So the entry point
also installs :class:`RequireKey` (``--middleware``), which requires one of the
decided keys on every route except ``/health`` (probes) and ``/metrics`` (the
Prometheus scraper). Who reaches the port at all is limited by the
NetworkPolicy (``deploy/base/networkpolicy.yaml``), and ``/metrics`` carries
nothing private (:mod:`vllm_lowrank.metrics`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence

from vllm_lowrank.errors import LowRankConfigError

KEY_FILE_ENV = "VLLM_API_KEY_FILE"
KEY_ENV = "VLLM_API_KEY"
OPT_OUT_ENV = "VLLM_LOWRANK_ALLOW_NO_API_KEY"
GUARD_KEYS_ENV = "VLLM_LOWRANK_API_KEYS"
"""The keys :class:`RequireKey` accepts (a JSON list), set by the entry point only."""
MAX_KEY_BYTES = 4096
OPEN_PATHS = frozenset({"/health", "/metrics"})
"""The only routes :class:`RequireKey` serves without a key."""
VLLM_MAIN = "vllm.entrypoints.cli.main"
"""The module of vLLM's ``vllm`` command (run with ``python -m``)."""

_KEY_FLAG = re.compile(r"--api[-_]k(?:e|ey)?(?==|$)")


def flag_keys(argv: Sequence[str]) -> list[str] | None:
    """The keys ``argv`` gives vLLM's ``--api-key`` (``nargs="+"``: the values
    up to the next option), ``None`` when the flag is absent.

    Raises:
        LowRankConfigError: the flag without a value, or an empty or blank key.
    """
    keys = None
    for i, arg in enumerate(argv):
        if not _KEY_FLAG.match(arg):
            continue
        flag, eq, value = arg.partition("=")
        if eq:
            values = [value]
        else:
            values = []
            for following in argv[i + 1:]:
                if following.startswith("-"):
                    break
                values.append(following)
        if not values:
            raise LowRankConfigError(f"{flag} has no value; give the key after it, or set "
                                     f"{KEY_FILE_ENV} to a file holding it")
        if any(not v.strip() for v in values):
            raise LowRankConfigError(
                f"{flag} is given an empty key, which would turn authentication off; give "
                f"the real key, or set {KEY_FILE_ENV} to a file holding it")
        keys = (keys or []) + values
    return keys


def serve_command(argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and environment to exec.

    Args:
        argv: Arguments after the program name (passed to ``vllm serve``).
        env: The current environment.

    Returns:
        ``(command, environment)``: ``command[0]`` is this interpreter
        (``sys.executable``, an absolute path); with a key, the command ends
        with ``--middleware vllm_lowrank.serve_entry.RequireKey`` and
        ``environment[GUARD_KEYS_ENV]`` lists the keys; the key file's content
        is in ``environment[VLLM_API_KEY]``.

    Raises:
        LowRankConfigError: no key anywhere (and no opt-out), an empty or blank
            key, a key both by flag and by file, or an unusable key file.
    """
    from vllm_lowrank.inputs import read_text

    env = dict(env)
    env.pop(GUARD_KEYS_ENV, None)  # only ever what this function decides
    keys = flag_keys(argv)
    if env.get(KEY_FILE_ENV):
        if keys is not None:
            raise LowRankConfigError(
                f"the API key is given twice, by --api-key and by {KEY_FILE_ENV}; give it "
                f"one way (in Kubernetes: the Secret file, {KEY_FILE_ENV})")
        key = read_text(env[KEY_FILE_ENV], f"{KEY_FILE_ENV} file", MAX_KEY_BYTES).strip()
        if not key:
            raise LowRankConfigError(f"{KEY_FILE_ENV} file {env[KEY_FILE_ENV]!r} is empty; put "
                                     "the API key in it (the Secret's value)")
        env[KEY_ENV] = key
    if env.get(KEY_ENV) and not env[KEY_ENV].strip():
        raise LowRankConfigError(f"{KEY_ENV} is blank; set it to the key, or unset it")
    if keys is None and env.get(KEY_ENV):
        keys = [env[KEY_ENV]]
    command = [sys.executable, "-P", "-m", VLLM_MAIN, "serve", *argv]
    if keys:
        env[GUARD_KEYS_ENV] = json.dumps(keys)
        return [*command, "--middleware", f"{__name__}.{RequireKey.__name__}"], env
    if env.get(OPT_OUT_ENV) != "1":
        raise LowRankConfigError(
            f"no API key: the server would answer anyone who reaches its port; set "
            f"{KEY_FILE_ENV} (a mounted Secret), {KEY_ENV} or --api-key, or "
            f"{OPT_OUT_ENV}=1 for a server on loopback only")
    return command, env


class RequireKey:
    """ASGI middleware that answers 401 to any request without ``Authorization:
    Bearer <key>`` for one of the keys in ``$VLLM_LOWRANK_API_KEYS`` (none: every
    request is refused), except on :data:`OPEN_PATHS` and CORS preflights
    (``OPTIONS``, as vLLM's own check). vLLM adds it through ``--middleware``.

    Args:
        app: The ASGI application it wraps.
    """

    def __init__(self, app) -> None:
        self.app = app
        keys = json.loads(os.environ.get(GUARD_KEYS_ENV) or "[]")
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def authorized(self, headers) -> bool:
        """Whether the ASGI ``headers`` carry a Bearer token among the keys
        (compared in constant time, as vLLM's own check does)."""
        value = dict(headers).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        digest = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and any(
            [hmac.compare_digest(digest, d) for d in self.digests])

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" \
                or path in OPEN_PATHS or self.authorized(scope.get("headers", [])):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = b'{"error":"Unauthorized"}'
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def main(argv: Sequence[str] | None = None) -> None:
    """Replace this process by ``vllm serve`` (see the module docstring); on a
    refusal print one ``vllm-lowrank: error:`` line and exit with status 2."""
    try:
        command, env = serve_command(sys.argv[1:] if argv is None else argv, os.environ)
    except LowRankConfigError as e:
        print(f"vllm-lowrank: error: {e}", file=sys.stderr)
        sys.exit(2)
    os.execve(command[0], command, env)

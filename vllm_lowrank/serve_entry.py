"""``vllm-lowrank-serve``: ``vllm serve``, closed by default (the image's entry point).

The entry point decides the API keys itself, then replaces its process
(``os.execve``) by the ``vllm serve`` of its own Python environment:
``sys.executable -P -c`` :data:`BOOTSTRAP` ``serve ARGS``, vLLM's command-line
entry point run by :func:`run_vllm`; never a ``vllm`` found on ``PATH``. The
keys come from one source, in this order:

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

The process it becomes runs vLLM's ``vllm`` command through :func:`run_vllm`,
which fixes two faults of vLLM 0.32's server for a supervisor such as
Kubernetes: a SIGTERM while the engine process starts was swallowed (the
server then hung for up to ten minutes instead of exiting within vLLM's
five-second shutdown), and a server whose engine process died exited with
status 0.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import signal
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
BOOTSTRAP = "from vllm_lowrank.serve_entry import run_vllm; run_vllm()"
"""What the entry point's ``python -P -c`` runs (``-P``: the working directory
is not on ``sys.path``, so a folder there cannot shadow a package)."""
ENGINE_DIED_STATUS = 1

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
        (``sys.executable``, an absolute path), which runs :func:`run_vllm`
        with ``serve`` and ``argv``; with a key, the command ends
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
    command = [sys.executable, "-P", "-c", BOOTSTRAP, "serve", *argv]
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


def run_vllm() -> None:
    """vLLM's ``vllm`` command on ``sys.argv[1:]`` (what the entry point
    execs), with :func:`stop_on_sigterm_during_startup` and
    :func:`note_engine_death` applied. Exits with vLLM's status,
    :data:`ENGINE_DIED_STATUS` when the engine process died under the server,
    or 128 + the signal's number (one line, no traceback) when SIGTERM or
    SIGINT stopped it during start-up."""
    stop_on_sigterm_during_startup()
    died = note_engine_death()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    try:
        vllm_main()
    except KeyboardInterrupt as e:  # vLLM's SIGTERM handler during start-up raises it
        stopped_by = signal.SIGTERM if e.args == ("terminated",) else signal.SIGINT
        print(f"vllm-lowrank: stopped by {stopped_by.name} during start-up", file=sys.stderr)
        # vLLM has stopped its engine processes; the interpreter's own
        # finalization can then block for many seconds on the half-built
        # engine client's objects, so it is skipped.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + stopped_by)
    if died:
        print("vllm-lowrank: error: the engine process died; exiting with status "
              f"{ENGINE_DIED_STATUS} so that the server is restarted", file=sys.stderr)
        sys.exit(ENGINE_DIED_STATUS)


def stop_on_sigterm_during_startup() -> None:
    """Let a SIGTERM stop ``vllm serve`` while its engine process starts.

    vLLM turns a SIGTERM during start-up into ``KeyboardInterrupt`` (in the
    API server's main thread), but the context manager around the engine's
    start-up handshake (``zmq_socket_ctx`` in ``launch_core_engines``)
    catches and drops it: the API server then waits ten minutes for an
    engine that waits five for it. Wrapped here so that the interrupt goes
    on, and vLLM stops its engine process (five seconds at most) and exits.
    """
    import contextlib

    from vllm.v1.engine import utils as engine_utils

    dropping = engine_utils.zmq_socket_ctx

    @contextlib.contextmanager
    def socket_ctx(*args, **kwargs):
        interrupted = None
        with dropping(*args, **kwargs) as socket:
            try:
                yield socket
            except KeyboardInterrupt as e:
                interrupted = e
                raise
        if interrupted is not None:
            raise interrupted

    engine_utils.zmq_socket_ctx = socket_ctx


def note_engine_death() -> list[bool]:
    """Record whether the engine process had died when the server shuts its
    engine client down (vLLM's ``AsyncLLM.errored`` at its first
    ``shutdown``; the server then exits normally, with status 0).

    Returns:
        A list that holds ``True`` once that happened.
    """
    import functools

    from vllm.v1.engine.async_llm import AsyncLLM

    died: list[bool] = []
    shutdown = AsyncLLM.shutdown

    @functools.wraps(shutdown)
    def shutdown_noting_death(self, *args, **kwargs):
        if not getattr(self, "_lowrank_shut_down", False):
            self._lowrank_shut_down = True
            if getattr(self, "engine_core", None) is not None and self.errored:
                died.append(True)
        return shutdown(self, *args, **kwargs)

    AsyncLLM.shutdown = shutdown_noting_death
    return died


def main(argv: Sequence[str] | None = None) -> None:
    """Replace this process by ``vllm serve`` (see the module docstring); on a
    refusal print one ``vllm-lowrank: error:`` line and exit with status 2."""
    try:
        command, env = serve_command(sys.argv[1:] if argv is None else argv, os.environ)
    except LowRankConfigError as e:
        print(f"vllm-lowrank: error: {e}", file=sys.stderr)
        sys.exit(2)
    os.execve(command[0], command, env)

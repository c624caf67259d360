"""``vllm-lowrank-serve`` (the image's entry point): it decides the API keys
itself, refuses an empty or doubled key, runs the vLLM of its own Python and
guards every route but ``/health`` and ``/metrics`` with the key (issues 23
and 54); the real server answers 401 without the key, stops within seconds on
a SIGTERM during start-up, and exits non-zero when its engine process dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

from vllm_lowrank import serve_entry
from vllm_lowrank.config import LowRankConfigError

ARGS = ["MODEL", "--host", "0.0.0.0"]
GUARD = ["--middleware", "vllm_lowrank.serve_entry.RequireKey"]
SERVE = [sys.executable, "-P", "-c", serve_entry.BOOTSTRAP, "serve"]


def test_key_file_becomes_the_environment_key(tmp_path):
    key = tmp_path / "api-key"
    key.write_text("s3cret\n")
    command, env = serve_entry.serve_command(ARGS, {"VLLM_API_KEY_FILE": str(key)})
    assert command == [*SERVE, *ARGS, *GUARD]
    assert env["VLLM_API_KEY"] == "s3cret"
    assert json.loads(env[serve_entry.GUARD_KEYS_ENV]) == ["s3cret"]
    assert "s3cret" not in " ".join(command)


@pytest.mark.parametrize("argv,env,keys", [
    (ARGS + ["--api-key", "k"], {}, ["k"]),
    (ARGS + ["--api-key=k"], {}, ["k"]),
    (ARGS + ["--api-key", "k1", "k2", "--port", "8000"], {}, ["k1", "k2"]),
    (ARGS + ["--api_key", "k"], {"VLLM_API_KEY": "other"}, ["k"]),  # the flag wins, as in vLLM
    (ARGS, {"VLLM_API_KEY": "k"}, ["k"]),
    (ARGS, {"VLLM_LOWRANK_ALLOW_NO_API_KEY": "1"}, None),
    (ARGS, {"VLLM_LOWRANK_ALLOW_NO_API_KEY": "1", "VLLM_LOWRANK_API_KEYS": '["injected"]'},
     None),
])
def test_other_ways_to_start(argv, env, keys):
    command, out_env = serve_entry.serve_command(argv, env)
    assert command == [*SERVE, *argv, *(GUARD if keys else [])]
    guarded = out_env.get(serve_entry.GUARD_KEYS_ENV)
    assert (json.loads(guarded) if guarded else None) == keys


def test_runs_the_python_of_its_own_environment(tmp_path):
    """Not a ``vllm`` found on ``PATH``: this interpreter, by absolute path,
    with ``-P`` (a ``triton_kernels/`` folder in the working directory, as in
    this repository, must not shadow vLLM's package)."""
    fake = tmp_path / "vllm"
    fake.write_text("#!/bin/sh\nexit 99\n")
    fake.chmod(0o755)
    command, _ = serve_entry.serve_command(ARGS, {"VLLM_API_KEY": "k", "PATH": str(tmp_path)})
    assert os.path.isabs(command[0]) and command[0] == sys.executable
    assert command[1] == "-P" and str(fake) not in command


REFUSALS = [
    ("--api-key empty", ["--api-key", ""], {}, "--api-key is given an empty key"),
    ("--api-key= empty", ["--api-key="], {}, "--api-key is given an empty key"),
    ("--api-key blank", ["--api-key", "  "], {}, "--api-key is given an empty key"),
    ("--api_key empty", ["--api_key", ""], {}, "--api_key is given an empty key"),
    ("--api-k empty (abbreviation)", ["--api-k="], {}, "--api-k is given an empty key"),
    ("second key empty", ["--api-key", "k", ""], {}, "is given an empty key"),
    ("--api-key last, no value", ["--api-key"], {}, "--api-key has no value"),
    ("--api-key before an option", ["--api-key", "--port", "8000"], {}, "has no value"),
    ("flag and file", ["--api-key", "k"], {"VLLM_API_KEY_FILE": "{key}"},
     "the API key is given twice, by --api-key and by VLLM_API_KEY_FILE"),
    ("blank VLLM_API_KEY", [], {"VLLM_API_KEY": " "}, "VLLM_API_KEY is blank"),
    ("no key", [], {"VLLM_API_KEY": ""}, "no API key"),
    ("empty key file", [], {"VLLM_API_KEY_FILE": "{empty}"}, "is empty; put the API key in it"),
    ("missing key file", [], {"VLLM_API_KEY_FILE": "{missing}"}, "does not exist"),
    ("opt-out does not excuse an empty key", ["--api-key="],
     {"VLLM_LOWRANK_ALLOW_NO_API_KEY": "1"}, "empty key"),
]


@pytest.mark.parametrize("extra,env,fragment", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_refusal_is_one_line_and_exit_2(extra, env, fragment, tmp_path, capsys, monkeypatch):
    (tmp_path / "key").write_text("s3cret")
    (tmp_path / "empty").write_text("\n")
    paths = {"key": str(tmp_path / "key"), "empty": str(tmp_path / "empty"),
             "missing": str(tmp_path / "missing")}
    for name in ("VLLM_API_KEY", "VLLM_API_KEY_FILE", "VLLM_LOWRANK_ALLOW_NO_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(**paths))
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("exec'd vllm"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        serve_entry.main([*ARGS, *extra])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vllm-lowrank: error: ") and fragment in line, line
    with pytest.raises(LowRankConfigError):  # the same refusal from the function
        serve_entry.serve_command([*ARGS, *extra], {k: v.format(**paths) for k, v in env.items()})


# ------------------------------------------------------------ the key guard

def _call(guard, path, headers=(), method="GET", kind="http", root_path=""):
    """One ASGI request through ``guard`` (its app replaced by a recorder);
    ``(reached the app, messages the guard sent)``."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    guard.app = app

    async def send(message):
        sent.append(message)

    scope = {"type": kind, "path": root_path + path, "root_path": root_path, "method": method,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    asyncio.run(guard(scope, None, send))
    return bool(reached), sent


@pytest.fixture
def guard(monkeypatch):
    monkeypatch.setenv(serve_entry.GUARD_KEYS_ENV, json.dumps(["k1", "k2"]))
    return serve_entry.RequireKey(None)


@pytest.mark.parametrize("path", ["/v1/models", "/invocations", "/tokenize", "/docs",
                                  "/scale_elastic_ep", "/version", "/ping", "/healthz"])
@pytest.mark.parametrize("headers", [(), (("Authorization", "Bearer wrong"),),
                                     (("Authorization", "Basic k1"),),
                                     (("Authorization", "Bearer"),)],
                         ids=["no key", "wrong key", "not bearer", "bearer without key"])
def test_guard_refuses_every_route_without_the_key(guard, path, headers):
    reached, sent = _call(guard, path, headers)
    assert not reached
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"]) == {"error": "Unauthorized"}


@pytest.mark.parametrize("headers,path", [
    ((("Authorization", "Bearer k1"),), "/invocations"),
    ((("Authorization", "Bearer k2"),), "/v1/completions"),
    ((("authorization", "bearer k1"),), "/tokenize"),
    ((), "/health"),
    ((), "/metrics"),
])
def test_guard_passes_the_key_and_the_open_routes(guard, headers, path):
    assert _call(guard, path, headers) == (True, [])


def test_guard_details(guard, monkeypatch):
    assert _call(guard, "/v1/models", method="OPTIONS")[0]  # CORS preflight, as vLLM's
    assert _call(guard, "/health", root_path="/api")[0]  # behind a path prefix
    assert not _call(guard, "/v1/models", root_path="/api")[0]
    reached, sent = _call(guard, "/v1/realtime", kind="websocket")
    assert not reached and sent == [{"type": "websocket.close", "code": 1008}]
    monkeypatch.delenv(serve_entry.GUARD_KEYS_ENV)  # no keys: only the open routes
    nobody = serve_entry.RequireKey(None)
    assert not _call(nobody, "/v1/models", (("Authorization", "Bearer "),))[0]
    assert _call(nobody, "/metrics")[0]


# ------------------------------------------------- the fixes of vLLM's server

def test_interrupt_during_the_engine_handshake_goes_on(monkeypatch, tmp_path):
    """vLLM's context manager around the engine's start-up handshake drops a
    ``KeyboardInterrupt`` (what its SIGTERM handler raises during start-up);
    wrapped, the interrupt goes on and the socket is still closed."""
    import zmq
    from vllm.v1.engine import utils as engine_utils

    address = f"ipc://{tmp_path}/handshake"

    def interrupted_handshake():
        with engine_utils.zmq_socket_ctx(address, zmq.ROUTER, bind=True) as sock:
            interrupted_handshake.socket = sock
            raise KeyboardInterrupt("terminated")

    interrupted_handshake()  # vLLM's own: nothing raised, the start-up goes on
    assert interrupted_handshake.socket.closed
    monkeypatch.setattr(engine_utils, "zmq_socket_ctx", engine_utils.zmq_socket_ctx)
    serve_entry.stop_on_sigterm_during_startup()
    with pytest.raises(KeyboardInterrupt, match="terminated"):
        interrupted_handshake()
    assert interrupted_handshake.socket.closed
    with engine_utils.zmq_socket_ctx(address, zmq.ROUTER, bind=True) as sock:  # no interrupt
        assert not sock.closed


def test_engine_death_is_noted_at_the_first_shutdown(monkeypatch):
    """The server's engine client is shut down once by its SIGTERM path and
    again on exit; a dead engine (vLLM's ``AsyncLLM.errored``) at the first
    call is what counts."""
    import types

    from vllm.v1.engine.async_llm import AsyncLLM

    calls = []
    monkeypatch.setattr(AsyncLLM, "shutdown", lambda self, timeout=None: calls.append(self))
    died = serve_entry.note_engine_death()

    class Client(AsyncLLM):  # no engine: just what ``errored`` reads
        def __del__(self):  # AsyncLLM's shuts the (absent) engine down
            pass

    def client(dead: bool) -> AsyncLLM:
        llm = Client.__new__(Client)
        llm.engine_core = types.SimpleNamespace(resources=types.SimpleNamespace(engine_dead=dead))
        llm.output_handler = None
        return llm

    healthy, dead = client(False), client(True)
    healthy.shutdown(timeout=5)
    assert died == [] and calls == [healthy]
    dead.shutdown()
    dead.engine_core.resources.engine_dead = False
    dead.shutdown()
    assert died == [True] and calls == [healthy, dead, dead]


def test_console_script_is_the_image_entry_point():
    import re
    import tomllib

    root = REPO
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vllm-lowrank-serve"] == "vllm_lowrank.serve_entry:main"
    dockerfile = (root / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["vllm-lowrank-serve"\]$', dockerfile, re.M)


# ------------------------------------------------------- the real server

ENTRY = os.path.join(os.path.dirname(sys.executable), "vllm-lowrank-serve")
SERVER_ARGS = ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048",
               "--enforce-eager"]


def _start(model: str, log_path, env: dict[str, str]) -> subprocess.Popen:
    """``vllm-lowrank-serve MODEL`` on a free loopback port, in a session of its
    own (its processes share one process group), from the repository root
    (which holds a ``triton_kernels/`` folder) with ``PATH`` lacking this
    virtualenv (so no ``vllm`` there)."""
    from server_harness import free_port

    port = free_port()
    env = {**os.environ, "PATH": "/usr/bin:/bin", **env}
    proc = subprocess.Popen([ENTRY, model, "--host", "127.0.0.1", "--port", str(port),
                             *SERVER_ARGS], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def _group_alive(pgid: int, wait: float = 15) -> list[str]:
    """Processes of process group ``pgid`` still running (zombies excepted)
    after up to ``wait`` seconds."""
    import psutil

    deadline = time.time() + wait
    while True:
        alive = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(p.info["cmdline"] or [])[:80])
            except (ProcessLookupError, psutil.Error):
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture(scope="module")
def keyed_server(model_path, tmp_path_factory):
    """``vllm-lowrank-serve`` with the key from a file (as the deployment)."""
    import requests

    folder = tmp_path_factory.mktemp("entry")
    (folder / "api-key").write_text("s3cret\n")
    log = folder / "server.log"
    proc = _start(model_path, log, {"VLLM_API_KEY_FILE": str(folder / "api-key")})
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        try:
            if requests.get(proc.url + "/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(1)
    assert proc.poll() is None, log.read_text()[-3000:]
    proc.log = log
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


@pytest.mark.slow
def test_server_needs_the_key_on_every_route(keyed_server):
    import requests

    url = keyed_server.url
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 2}
    key = {"Authorization": "Bearer s3cret"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert requests.get(url + "/v1/models", headers=headers, timeout=30).status_code == 401
        # vLLM's own check leaves these open; the entry point's guard does not
        assert requests.post(url + "/invocations", json=body, headers=headers,
                             timeout=30).status_code == 401
        assert requests.post(url + "/tokenize", json=body, headers=headers,
                             timeout=30).status_code == 401
    models = requests.get(url + "/v1/models", headers=key, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
    done = requests.post(url + "/invocations", json=body, headers=key, timeout=120)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert requests.get(url + "/metrics", timeout=30).status_code == 200
    # the process is this virtualenv's Python running vLLM (exec kept the pid)
    with open(f"/proc/{keyed_server.pid}/cmdline", "rb") as f:
        cmdline = f.read().split(b"\0")
    assert [a.decode() for a in cmdline[:5]] == SERVE[:4] + ["serve"]


@pytest.mark.slow
def test_engine_death_exits_nonzero(keyed_server):
    """Last on the shared server: SIGKILL its engine process; the server exits
    with status 1 (vLLM alone exits 0) within a minute."""
    import psutil

    (engine,) = [p for p in psutil.Process(keyed_server.pid).children(recursive=True)
                 if "EngineCore" in " ".join(p.cmdline())]
    engine.kill()
    assert keyed_server.wait(60) == serve_entry.ENGINE_DIED_STATUS
    log = keyed_server.log.read_text()
    assert "vllm-lowrank: error: the engine process died" in log
    # the dead engine's worker notices its parent is gone and exits by itself
    assert not _group_alive(keyed_server.pid, wait=120)


@pytest.mark.slow
@pytest.mark.parametrize("marker,statuses", [
    ("non-default args", (143, -signal.SIGTERM)),  # before vLLM installs its handler: killed
    ("(EngineCore pid=", (143,)),  # the engine's start-up handshake
    ("(Worker pid=", (143,)),  # the worker starts; the front end waits for the engine
], ids=["front end", "engine handshake", "engine loading"])
def test_sigterm_during_startup_exits_within_seconds(model_path, tmp_path, marker, statuses):
    """SIGTERM when the log first shows ``marker``: the server stops its
    engine (vLLM gives it 5 s) and exits within 30 s, leaving no process.
    Before the fix a SIGTERM during the engine's start-up was dropped and the
    server hung for 10 minutes."""
    log = tmp_path / "server.log"
    proc = _start(model_path, log, {"VLLM_API_KEY": "k"})
    deadline = time.time() + 600
    while marker not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None and marker in log.read_text(), log.read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("still running 30 s after SIGTERM:\n" + log.read_text()[-3000:])
    text = log.read_text()
    assert status in statuses, text[-3000:]
    if status == 143:
        assert "vllm-lowrank: stopped by SIGTERM during start-up" in text
    assert "Traceback" not in text
    assert not _group_alive(proc.pid)

"""Faults and bad input against a compressed ``vllm serve`` (one shared server):
malformed and oversized requests get 4xx and the server keeps serving; a
stream closed by the client frees its KV blocks; damaged or mismatched
calibration artifacts are refused at start-up with one line and a non-zero
exit; SIGTERM drains the in-flight request and exits 0 (last test: it stops
the shared server)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import requests
from conftest import calibrated
from server_harness import VLLM, Server, free_port

pytestmark = pytest.mark.slow

LONG_TEXT = ("The committee met on Tuesday to review the budget, and after a long debate "
             "the members agreed to postpone the decision until the next session. ") * 20


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    s = Server(model_path, "--kv-compression", "lowrank",
               "--kv-compression-config", '{"rank_fraction": 0.5}', "--shutdown-timeout", "60",
               log_dir=str(tmp_path_factory.mktemp("faults")))
    yield s
    s.stop()


def _serves(server) -> None:
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    r = requests.post(server.url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


BAD_REQUESTS = {
    "malformed JSON": dict(data=b'{"model": "m", "prompt": ', json=None),
    "body is a list": dict(json=["m", "hello"]),
    "no prompt": dict(json={"model": "m", "max_tokens": 4}),
    "unknown model": dict(json={"model": "nope", "prompt": "hi", "max_tokens": 4}),
    "negative max_tokens": dict(json={"model": "m", "prompt": "hi", "max_tokens": -1}),
    "temperature not a number": dict(json={"model": "m", "prompt": "hi", "temperature": "hot"}),
    "token id out of vocabulary": dict(json={"model": "m", "prompt": [1, 10**9], "max_tokens": 2}),
    "prompt longer than the context": dict(json={"model": "m", "prompt": [42] * 3000,
                                                "max_tokens": 2}),
    "max_tokens beyond the context": dict(json={"model": "m", "prompt": "hi",
                                               "max_tokens": 100_000}),
    "1 MB prompt": dict(json={"model": "m", "prompt": "word " * 200_000, "max_tokens": 2}),
}


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    statuses = {}
    for name, kwargs in BAD_REQUESTS.items():
        r = requests.post(server.url + "/v1/completions", timeout=120,
                          headers={"Content-Type": "application/json"}, **kwargs)
        statuses[name] = r.status_code
    bad_chat = requests.post(server.url + "/v1/chat/completions", timeout=60,
                             json={"model": "m", "messages": "not a list"})
    statuses["chat messages not a list"] = bad_chat.status_code
    wrong = {k: v for k, v in statuses.items() if not 400 <= v < 500}
    assert not wrong, statuses
    assert statuses["unknown model"] == 404
    _serves(server)
    assert server.proc.poll() is None


def test_cancelled_stream_frees_its_blocks(server):
    idle = server.wait_metric("vllm:num_requests_running", lambda v: v == 0, 60)
    assert idle == 0
    idle_usage = server.metric("vllm:kv_cache_usage_perc")
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=120, json={
        "model": "m", "prompt": LONG_TEXT, "max_tokens": 1500, "ignore_eos": True,
        "temperature": 0, "stream": True})
    assert r.status_code == 200
    chunks = r.iter_lines()
    received = 0
    for line in chunks:
        if line.startswith(b"data: {"):
            received += 1
            if received == 5:
                break
    busy = server.metric("vllm:kv_cache_usage_perc")
    assert busy > idle_usage and server.metric("vllm:num_requests_running") == 1
    r.close()  # the client goes away mid-stream
    running = server.wait_metric("vllm:num_requests_running", lambda v: v == 0, 60)
    usage = server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == idle_usage, 60)
    assert (running, usage) == (0, idle_usage), (busy, idle_usage)
    _serves(server)


# ------------------------------------------------------------- artifacts

def _artifact_in_use(server, model_path: str) -> str:
    """The cached ``artifact: "auto"`` folder of the server's settings; the
    server's metrics name it by digest (never by path)."""
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.calibration.cache import auto_artifact_path
    from vllm_lowrank.config import LowRankConfig

    path = auto_artifact_path(model_path, LowRankConfig.from_dict(
        calibrated({"mode": "lowrank", "rank_fraction": 0.5})))
    (digest,) = [labels["artifact"] for name, labels, _ in server.metrics()
                 if name == "vllm_lowrank_info"]
    assert digest == art.load_artifact(path).digest
    return path


def _damage(src: str, dst: str, how: str) -> str:
    """A copy of artifact ``src`` at ``dst`` damaged as ``how``; the expected
    fragment of the refusal message."""
    from safetensors.torch import load_file, save_file

    from vllm_lowrank.calibration import artifact as art

    shutil.copytree(src, dst)
    tensors_path, manifest_path = os.path.join(dst, art.TENSORS), os.path.join(dst, art.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    if how == "truncated":
        size = os.path.getsize(tensors_path)
        with open(tensors_path, "r+b") as f:
            f.truncate(size // 3)
        return "bases.safetensors is truncated or corrupt"
    if how == "wrong shapes":
        tensors = load_file(tensors_path)
        tensors["l3.k0.a"] = tensors["l3.k0.a"][:, :-8].contiguous()
        save_file(tensors, tensors_path)
        return "l3.k0 has shapes"
    if how == "other geometry":
        manifest["model"]["num_layers"] = 24
        manifest["model"]["head_dim"] = 128
    elif how == "other weights":
        manifest["model"]["id"] = "another-model"
        manifest["model"]["fingerprint"] = "0" * 32
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return {"other geometry": "was made for another model",
            "other weights": "does not match the served weights"}[how]


def test_intact_artifact_matches_the_checkpoint(server, model_path):
    from vllm_lowrank.calibration import artifact as art

    manifest = art.read_manifest(_artifact_in_use(server, model_path))
    assert art.checkpoint_fingerprint(model_path) == manifest["model"]["fingerprint"]


def test_manifest_without_a_field_is_refused(server, model_path, tmp_path):
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.config import LowRankConfigError

    path = str(tmp_path / "artifact")
    shutil.copytree(_artifact_in_use(server, model_path), path)
    manifest_path = os.path.join(path, art.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    del manifest["model"]["hidden_size"]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(LowRankConfigError, match="missing or invalid 'model.hidden_size'"):
        art.load_artifact(path)


@pytest.mark.parametrize("how", ["truncated", "wrong shapes", "other geometry",
                                 "other weights"])
def test_damaged_artifact_is_refused_at_startup(server, model_path, tmp_path, how):
    path = str(tmp_path / "artifact")
    expected = _damage(_artifact_in_use(server, model_path), path, how)
    proc = subprocess.run(
        [VLLM, "serve", model_path, "--host", "127.0.0.1", "--port", str(free_port()),
         "--dtype", "float32",
         "--kv-compression", "lowrank", "--kv-compression-config",
         json.dumps({"artifact": path, "rank_fraction": 0.5})],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "vllm-lowrank: error:" in line]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert expected in lines[0] and path in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "EngineCore" not in proc.stderr


# ------------------------------------------------------ shutdown (last)

def test_sigterm_drains_in_flight_request_and_exits_0(server):
    result, code = server.sigterm_in_flight(LONG_TEXT, 48)
    assert result.get("status") == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 48
    assert code == 0
    assert "mode=drain" in server.text()

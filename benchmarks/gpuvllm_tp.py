"""Tensor parallelism on the GPU machine's recipe (``../shared/gpu-vllm``), applied by
``prepare_gpuvllm.sh`` to its staged copy of vLLM.

The recipe carries vLLM's Python sources without its compiled module. At
``tensor_parallel_size > 1`` on CUDA, vLLM's ``VocabParallelEmbedding`` (vLLM 0.32 and
0.33 alike, ``vllm/model_executor/layers/vocab_parallel_embedding.py``) looks up its
rows with the compiled ``torch.ops._C.vocab_parallel_embedding``, which the recipe has
not got: every TP engine's first forward fails. :data:`PATCHES` makes that choice also
ask whether the op exists (the recipe's stub answers ``hasattr`` with ``False``), so the
layer takes vLLM's own torch path (mask, shift, gather, zero the rows of other shards)
that every other platform runs. Nothing in the project changes.

    python3 benchmarks/gpuvllm_tp.py <staged>/vllm    # prints one line per patch
"""

from __future__ import annotations

import sys

from gpuvllm_flashinfer import main

EMBEDDING = "model_executor/layers/vocab_parallel_embedding.py"

PATCHES = [
    (EMBEDDING,
     "            and isinstance(quant_method, UnquantizedEmbeddingMethod)\n        )\n",
     "            and isinstance(quant_method, UnquantizedEmbeddingMethod)\n"
     "            # gpuvllm patch: the fused lookup is a compiled op\n"
     "            and hasattr(torch.ops._C, \"vocab_parallel_embedding\")\n        )\n"),
]
"""``(file under vllm/, old text, new text)``: each old text must occur exactly once."""

if __name__ == "__main__":
    main(sys.argv[1], PATCHES)

#!/usr/bin/env bash
# On the GPU machine, from the project root: unpack the flashinfer-python that
# `benchmarks/prepare_gpuvllm.sh --flashinfer` put in .gpuvllm-flashinfer/ into
# /tmp/gpuvllm_flashinfer/site (/tmp stays while the machine is warm) and write
# /tmp/gpuvllm_flashinfer/env.sh, which later calls source after .gpuvllm/env.sh:
#
#   bash benchmarks/gpuvllm_flashinfer_install.sh          # once per machine
#   source .gpuvllm/env.sh && source /tmp/gpuvllm_flashinfer/env.sh && python3 -P ...
#
# Only FlashInfer's engines in gpu_serving.py put the site on PYTHONPATH. FlashInfer's
# kernels JIT-compile with the machine's nvcc and ninja on first use into
# /tmp/gpuvllm_flashinfer/.cache (FLASHINFER_WORKSPACE_BASE), reused by later engines.
set -euo pipefail
SRC=${1:-.gpuvllm-flashinfer}
DEST=/tmp/gpuvllm_flashinfer
ARCHIVE=$(ls "$SRC"/flashinfer_python-*.tar.xz 2>/dev/null | head -1 || true)
[ -n "$ARCHIVE" ] || { echo "no $SRC/flashinfer_python-*.tar.xz (carry .gpuvllm-flashinfer)" >&2; exit 2; }
VER=$(basename "$ARCHIVE" .tar.xz); VER=${VER#flashinfer_python-}
if [ ! -f "$DEST/site/.ok-$VER" ]; then
  rm -rf "$DEST/site"; mkdir -p "$DEST/site"
  # the wheel's files, packed with xz (the wheel itself is up to 62 MB)
  python3 -c "import sys, tarfile; kw = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **kw)" "$ARCHIVE" "$DEST/site"
  touch "$DEST/site/.ok-$VER"
fi
# vLLM turns FlashInfer off without nvcc (CUDA_HOME, PATH or /usr/local/cuda) and ninja
NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] || echo "warning: no nvcc" >&2
command -v ninja >/dev/null || echo "warning: no ninja on PATH: vLLM disables FlashInfer" >&2
cat > "$DEST/env.sh" <<EOF
# written by benchmarks/gpuvllm_flashinfer_install.sh (flashinfer-python $VER)
export GPUVLLM_FLASHINFER_SITE=$DEST/site
export FLASHINFER_WORKSPACE_BASE=$DEST
export MAX_JOBS=\${MAX_JOBS:-$(nproc)}
EOF
echo "flashinfer-python $VER in $DEST/site ($(du -sh "$DEST/site" | cut -f1)); nvcc: ${NVCC:-none}" \
     "($(nvcc --version 2>/dev/null | tail -1 || true)); ninja: $(command -v ninja || echo none)"
# import check, with the recipe's wheels (apache-tvm-ffi) when .gpuvllm/env.sh ran first
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$DEST/site python3 -c \
    "import flashinfer; print('import flashinfer', flashinfer.__version__)" \
    || echo "warning: flashinfer does not import (source .gpuvllm/env.sh first?)" >&2

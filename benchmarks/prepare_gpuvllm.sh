#!/usr/bin/env bash
# Build .gpuvllm/ in the project root, as the GPU machine's recipe does
# (../shared/gpu-vllm/prepare.sh, README.md there), from the Python sources of
# vLLM 0.32 (.venv's CPU wheel; the default) or 0.33 (the vllm==0.33.0 release
# wheel, taken from ~/.cache/vllm-lowrank-test, else `pip download`ed there;
# never installed here).
#
#   bash benchmarks/prepare_gpuvllm.sh [--vllm 0.32|0.33] [--flashinfer]   # from the project root, after make setup
#
# Then, on the GPU machine: source .gpuvllm/env.sh && python3 -P ...
#
# --flashinfer (stock vLLM on FlashInfer, gpu_serving.py's stock-flashinfer* configs;
# benchmarks/README.md, "Stock FlashInfer"): also builds .gpuvllm-flashinfer/, the
# flashinfer-python release this vLLM pins (benchmarks/gpuvllm_flashinfer.py), its wheel's
# files packed with xz (62 MB wheel -> 17 MB), in a folder of its own so that .gpuvllm
# stays as small as before; and patches vLLM's FlashInfer backend in .gpuvllm where it
# calls compiled vLLM ops (the KV cache write, the FP8 query quantization).
# The recipe's own files (shim/, env.sh, wheels.txt, models/, bench_*.py) are read
# from $GPUVLLM_RECIPE (default ../shared/gpu-vllm), not copied into this repo.
set -euo pipefail
VER=0.32
FLASHINFER=0
while [ $# -gt 0 ]; do
  case $1 in
    --vllm) VER=${2:-}; shift $(( $# > 1 ? 2 : 1 ));;
    --vllm=*) VER=${1#--vllm=}; shift;;
    --flashinfer) FLASHINFER=1; shift;;
    *) echo "usage: $0 [--vllm 0.32|0.33] [--flashinfer]" >&2; exit 2;;
  esac
done
case $VER in 0.32|0.33) ;; *) echo "--vllm takes 0.32 or 0.33, not '$VER'" >&2; exit 2;; esac
[ -f pyproject.toml ] || { echo "run from the project root" >&2; exit 2; }
ROOT=$(pwd)
BENCH=$(cd "$(dirname "$0")" && pwd)
RECIPE=$(cd "${GPUVLLM_RECIPE:-../shared/gpu-vllm}" && pwd)
[ -f "$RECIPE/shim/patch_vllm.py" ] || { echo "no GPU recipe at $RECIPE (set GPUVLLM_RECIPE)" >&2; exit 2; }
SITE=$(ls -d .venv/lib/python3*/site-packages | head -1)
[ -d "$SITE/vllm" ] || { echo "no vLLM in .venv: run make setup first" >&2; exit 2; }
TOK=${GPUVLLM_TOKENIZER:-$HOME/.cache/vllm_lowrank/models/smollm2-135m}
[ -f "$TOK/tokenizer.json" ] || { echo "no tokenizer at $TOK (make setup converts the embedded model)" >&2; exit 2; }
OUTDIR=$ROOT/.gpuvllm
mkdir -p "$OUTDIR/whl" "$OUTDIR/models"
if [ -d .git ] || [ -f .git ]; then
  EXCL=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$EXCL")"; grep -qx '/.gpuvllm/' "$EXCL" 2>/dev/null || echo '/.gpuvllm/' >> "$EXCL"
  grep -qx '/.gpuvllm-flashinfer/' "$EXCL" 2>/dev/null || echo '/.gpuvllm-flashinfer/' >> "$EXCL"
fi

# 1. Wheels the GPU image lacks (cp312, manylinux x86_64), one version each.
#    0.33 adds orjson (Requires-Dist orjson>=3.11.6, new in 0.33, absent from the
#    GPU image): vllm/entrypoints/serve/utils/api_utils.py imports it at module level,
#    on the OpenAI server's import path (`vllm serve`), not on the offline LLM's.
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64"
WHEELS=$(cat "$RECIPE/wheels.txt")
[ "$VER" = 0.33 ] && WHEELS="$WHEELS"$'\n'"orjson==3.13.0"
[ "$VER" = 0.32 ] && rm -f "$OUTDIR"/whl/orjson-*.whl
while read -r spec; do
  [ -z "$spec" ] && continue
  name=${spec%%==*}; norm=$(echo "$name" | tr '-' '_')
  ls "$OUTDIR/whl/" 2>/dev/null | grep -qi "^${norm}-" && continue
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp $PLAT -d "$OUTDIR/whl" "$spec"
done <<< "$WHEELS"

# 2. vLLM's Python sources (no compiled code), the stub for its compiled module, a
#    version record without "cpu" (so CUDA is detected; 0.33 reads it with no
#    fallback), and the recipe's text patches.
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
if [ "$VER" = 0.32 ]; then
  (cd "$SITE" && tar cf - --exclude='*.so' --exclude='__pycache__' --exclude='*.pyc' vllm) | (cd "$STAGE" && tar xf -)
else
  CACHE=$HOME/.cache/vllm-lowrank-test
  WHEEL=$(ls "$CACHE"/vllm-0.33.0-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$WHEEL" ] && [ ! -f "$CACHE/vllm-0.33.0/vllm/__init__.py" ]; then
    mkdir -p "$CACHE"
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
        --platform manylinux_2_28_x86_64 -d "$CACHE" vllm==0.33.0
    WHEEL=$(ls "$CACHE"/vllm-0.33.0-*.whl | head -1)
  fi
  if [ -n "$WHEEL" ]; then
    # Everything under vllm/ but compiled code (*.so, the 60 MB Rust frontend
    # binary vllm/vllm-rs, off unless VLLM_USE_RUST_FRONTEND) and the C++/CUDA
    # sources and headers that DeepGEMM and FMHA-sm100 compile at run time (56 MB
    # unpacked; DeepGEMM's compiled half is a dropped .so, FMHA-sm100 is Blackwell's).
    .venv/bin/python - "$WHEEL" "$STAGE" <<'EOF'
import sys, zipfile
skip = (".so", ".pyc", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/")
                               and n != "vllm/vllm-rs" and not n.endswith(skip)
                               and "/__pycache__/" not in n])
EOF
  else  # the test suite's unpacked copy: .py files only (no chat templates, no MoE configs)
    echo "note: no vllm-0.33.0 wheel in $CACHE; using its .py files only" >&2
    cp -r "$CACHE/vllm-0.33.0/vllm" "$STAGE/vllm"
  fi
fi
cp "$RECIPE/shim/_C_stable_libtorch.py" "$STAGE/vllm/_C_stable_libtorch.py"
mkdir -p "$STAGE/vllm-$VER.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s.0\n' "$VER" > "$STAGE/vllm-$VER.0.dist-info/METADATA"
# patch_vllm.py exits non-zero when a target text is missing; every patch must report.
PATCHED=$(python3 "$RECIPE/shim/patch_vllm.py" "$STAGE/vllm")
NPATCH=$(python3 -c "import runpy, sys; print(len(runpy.run_path(sys.argv[1])['PATCHES']))" "$RECIPE/shim/patch_vllm.py")
[ "$(grep -c '^patched: ' <<< "$PATCHED")" = "$NPATCH" ] || { echo "patch_vllm.py: $PATCHED" >&2; exit 1; }
# vLLM's embedding at tensor_parallel_size > 1 without its compiled lookup
python3 "$BENCH/gpuvllm_tp.py" "$STAGE/vllm"
# --flashinfer: vLLM's FlashInfer backend without compiled vLLM ops (exits non-zero
# when a target text moved); gpu_serving.py refuses FlashInfer engines without it
if [ "$FLASHINFER" = 1 ]; then python3 "$BENCH/gpuvllm_flashinfer.py" "$STAGE/vllm"; fi
(cd "$STAGE" && tar czf "$OUTDIR/vllm_src.tgz" vllm "vllm-$VER.0.dist-info")

# 3. Model configs (random "dummy" weights on the device) with the tokenizer.
for m in "$RECIPE"/models/*/; do
  d="$OUTDIR/models/$(basename "$m")"; mkdir -p "$d"; cp "$m"config.json "$d/"
  cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$d/"
  [ -f "$TOK/chat_template.jinja" ] && cp "$TOK/chat_template.jinja" "$d/"
done
cp "$RECIPE/bench_generate.py" "$RECIPE/bench_plugin.py" "$OUTDIR/"
# env.sh, with two changes so that one warm machine can take either series in turn:
# it removes any vllm-*.dist-info before unpacking (the recipe removes 0.32's only,
# and importlib.metadata would then see two vLLM versions), and it reinstalls the
# wheels when the series changed (the recipe's marker installs them once per machine).
python3 - "$RECIPE/env.sh" "$OUTDIR/env.sh" "$VER" <<'EOF'
import sys
text = open(sys.argv[1]).read()
for old, new in (('"$GPUVLLM_SITE"/vllm-0.32.0.dist-info', '"$GPUVLLM_SITE"/vllm-[0-9]*.dist-info'),
                 ('$GPUVLLM_SITE/.ok', f'$GPUVLLM_SITE/.ok-{sys.argv[3]}')):
    if old not in text:
        sys.exit(f"env.sh: {old!r} not found (the recipe changed)")
    text = text.replace(old, new)
open(sys.argv[2], "w").write(text)
EOF

# 4. --flashinfer: .gpuvllm-flashinfer/ with the pinned flashinfer-python (cached in
#    ~/.cache/vllm-lowrank-gpu/flashinfer). Its Python needs are on the GPU image
#    (numpy, requests, ninja, nvidia-ml-py, cuda-bindings, einops, tabulate, click, tqdm,
#    packaging) or in .gpuvllm (apache-tvm-ffi); `import flashinfer` and vLLM's
#    FlashInfer backend import without cuda-tile, nccl4py, nccl-extensions,
#    nvidia-cudnn-frontend and nvidia-cutlass-dsl (CuTe-DSL, cuDNN and NCCL paths only).
FIDIR=$ROOT/.gpuvllm-flashinfer
rm -rf "$FIDIR"
if [ "$FLASHINFER" = 1 ]; then
  FIV=$(python3 -c 'import runpy, sys; print(runpy.run_path(sys.argv[1])["FLASHINFER_PINS"][sys.argv[2]])' \
        "$BENCH/gpuvllm_flashinfer.py" "$VER")
  if [ "$VER" = 0.33 ] && [ -n "${WHEEL:-}" ]; then  # the release wheel names its pin
    PIN=$(unzip -p "$WHEEL" 'vllm-*.dist-info/METADATA' | sed -n 's/^Requires-Dist: flashinfer-python==//p')
    [ "$PIN" = "$FIV" ] || { echo "vllm 0.33 pins flashinfer-python $PIN, FLASHINFER_PINS says $FIV" >&2; exit 1; }
  fi
  FICACHE=$HOME/.cache/vllm-lowrank-gpu/flashinfer
  mkdir -p "$FICACHE"
  FIWHL=$FICACHE/flashinfer_python-$FIV-py3-none-any.whl
  [ -f "$FIWHL" ] || .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp $PLAT -d "$FICACHE" "flashinfer-python==$FIV"
  FIXZ=$FICACHE/flashinfer_python-$FIV.tar.xz
  if [ ! -f "$FIXZ" ]; then  # about 2 min on 2 cores
    FISTAGE=$(mktemp -d)
    (cd "$FISTAGE" && unzip -q "$FIWHL" && tar cf - . | xz -6 -T0 > "$FIXZ.part") && mv "$FIXZ.part" "$FIXZ"
    rm -rf "$FISTAGE"
  fi
  mkdir -p "$FIDIR"; cp "$FIXZ" "$FIDIR/"
  echo "flashinfer-python $FIV: wheel $(du -h "$FIWHL" | cut -f1), carried as $(du -h "$FIXZ" | cut -f1) xz"
fi
du -sh "$OUTDIR"
echo "ready (vLLM $VER): send .gpuvllm/ with the work tree; on the GPU machine: source .gpuvllm/env.sh && python3 -P ..."
if [ "$FLASHINFER" = 1 ]; then
  TREE=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  BOTH=$(( TREE + $(du -sb "$OUTDIR" | cut -f1) + $(du -sb "$FIDIR" | cut -f1) ))
  echo "stock FlashInfer (benchmarks/README.md, \"Stock FlashInfer\"): work tree + .gpuvllm + .gpuvllm-flashinfer = $(( BOTH / 1048576 )) MiB of the 64 a call carries"
  if [ "$BOTH" -lt $(( 62 * 1048576 )) ]; then
    echo "  call 1, carry [.gpuvllm, .gpuvllm-flashinfer]: source .gpuvllm/env.sh && bash benchmarks/gpuvllm_flashinfer_install.sh && source /tmp/gpuvllm_flashinfer/env.sh && python3 -P benchmarks/gpu_serving.py --configs stock-flashinfer,... (a short run: FlashInfer's kernels JIT-compile)"
  else
    echo "  call 1, carry [.gpuvllm-flashinfer]: bash benchmarks/gpuvllm_flashinfer_install.sh"
  fi
  echo "  later calls (within 30 s of the last, the same warm machine), carry [.gpuvllm]: source .gpuvllm/env.sh && source /tmp/gpuvllm_flashinfer/env.sh && python3 -P benchmarks/gpu_serving.py --configs stock,stock-flashinfer,..."
fi

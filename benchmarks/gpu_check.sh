#!/usr/bin/env bash
# The whole GPU check in one prepared run (a few minutes on one H100/H200-class GPU): the
# kernels, with the tuning sweep, then the engine around them. Run from the repository root
# with a Python that has CUDA torch, Triton and transformers (the project need not be installed;
# xgrammar is optional, its check says so when missing):
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]     # writes kernels_gpu.json and engine_gpu.json
#
# Exit status: 0 when every check of both scripts passed.
set -uo pipefail
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
"$python" -c 'import torch, sys
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device for torch {torch.__version__}: run this on a machine with an NVIDIA GPU")
print(torch.__version__, torch.cuda.get_device_name())' || exit 2
"$python" benchmarks/kernels_gpu.py --sweep --json "$out/kernels_gpu.json"; kernels=$?
"$python" benchmarks/engine_gpu.py --json "$out/engine_gpu.json"; engine=$?
echo "kernels_gpu.py exit $kernels, engine_gpu.py exit $engine"
exit $(( kernels != 0 || engine != 0 ))

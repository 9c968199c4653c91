#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels scripts/gpu_check.sh needs besides torch (and wandb, which
# the check turns off) for the GPU machine's CPython, so that the check installs them there offline:
#
#   scripts/gpu_wheels.sh DIR [PYTHON_VERSION]     # default 3.12; manylinux x86_64 wheels
#   scripts/gpu_check.sh OUT DIR                   # on the GPU machine: pip install --no-index --target
#
# DeepSpeed has no wheel on PyPI: its pure-Python wheel is built here with DS_BUILD_OPS=0 (its kernels are JIT-built
# on the GPU machine when used). The check runs arithmetic, agent and chat stages with the rule judge: dataset
# files (pyarrow, datasets), math-verify, the judge's openai client and matplotlib (report.md then has no plots)
# are not needed. At most 64 MiB in all:
# the total is printed, and more fails.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: scripts/gpu_wheels.sh DIR [PYTHON_VERSION]}
PYVER=${2:-3.12}
LIMIT_MIB=64
PY=${PYTHON:-.venv/bin/python}
DEEPSPEED=$(grep -o '"deepspeed==[^"]*"' setup.py | tr -d '"')
# what the check imports, besides torch (setup.py's install_requires less the above) and DeepSpeed's own
# requirements besides torch
NEEDED="transformers>=4.50 tokenizers safetensors pydantic>=2 pyyaml zarr>=3 numcodecs numpy tqdm
requests urllib3>=2 fastapi uvicorn anyio orjson hjson ninja packaging psutil py-cpuinfo msgpack einops nvidia-ml-py"
mkdir -p "$DIR"
# shellcheck disable=SC2086  # one requirement a word
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --dest "$DIR" $NEEDED
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
  --wheel-dir "$DIR" "$DEEPSPEED"
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels for CPython $PYVER in $DIR: $((total / 1048576)) MiB ($total bytes; limit $LIMIT_MIB MiB)"
if [ "$total" -gt $((LIMIT_MIB << 20)) ]; then
  echo "gpu_wheels: over $LIMIT_MIB MiB" >&2
  exit 1
fi

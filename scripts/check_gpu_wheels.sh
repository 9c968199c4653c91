#!/usr/bin/env bash
# Checks the offline route of scripts/gpu_check.sh for one CPython that has a CUDA torch (2.4 or newer) and none of
# the other dependencies: scripts/gpu_wheels.sh makes the wheel set for that Python's version (network; the download
# runs with .venv's Python, as that script does), then gpu_check.sh installs it with that Python and no network
# (`unshare -n` where allowed, else PIP_NO_INDEX and a proxy that leads nowhere). Without a GPU the check must stop
# at "no NVIDIA GPU" (exit 2) after "N wheels installed"; with one it runs the full check. A manual check, not a
# test (CI has one Python). docs/scale_out.md ("Offline, beside a CUDA torch") has the CPython 3.12 result.
#
#   scripts/check_gpu_wheels.sh PYTHON [DIR]   # DIR: the wheel directory, made afresh unless it already holds
#                                              # wheels (default build/gpu_wheels-X.Y)
#   CPU_RUN=1                                  # then also configs/gpu_check.yaml on the CPU (torch backend) with
#                                              # PYTHON and only those wheels, offline: ~10 minutes on 2 cores
#
# Such a Python, e.g. from pyenv's CPython 3.12 (PyPI's manylinux torch is the CUDA build):
#   python3.12 -m venv /tmp/py312/venv && /tmp/py312/venv/bin/pip install torch==2.14.1
set -euo pipefail
PYTHON=$(command -v "${1:?usage: scripts/check_gpu_wheels.sh PYTHON [DIR]}") || { echo "check_gpu_wheels: no $1" >&2; exit 1; }
[[ $PYTHON == /* ]] || PYTHON=$PWD/$PYTHON  # as given, from here (not resolved: a venv's python is a link)
DIR=${2:-}
[[ -z $DIR || $DIR == /* ]] || DIR=$PWD/$DIR
cd "$(dirname "$0")/.."
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
torch=$("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null) \
  || { echo "check_gpu_wheels: $PYTHON has no torch" >&2; exit 1; }
DIR=${DIR:-build/gpu_wheels-$version}
echo "check_gpu_wheels: $PYTHON (CPython $version), torch $torch"
if ! ls "$DIR"/*.whl >/dev/null 2>&1; then
  scripts/gpu_wheels.sh "$DIR" "$version" 2> >(grep -v "is ignored: it is neither" >&2)
fi

offline=(env PIP_NO_INDEX=1 https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 HF_HUB_OFFLINE=1)
if unshare -n true 2>/dev/null; then
  offline=(unshare -n "${offline[@]}")
fi
log=build/check_gpu_wheels.log
mkdir -p build
start=$(date +%s)
status=0
"${offline[@]}" PYTHON="$PYTHON" scripts/gpu_check.sh build/check_gpu_wheels.txt "$DIR" > "$log" 2>&1 || status=$?
grep -v "is ignored: it is neither" "$log" || true
echo "check_gpu_wheels: gpu_check.sh exit $status after $(($(date +%s) - start)) s (${offline[0]}; log $log)"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  exit "$status"  # a GPU: the full check ran (its report: build/check_gpu_wheels.txt)
fi
if [ "$status" != 2 ] || ! grep -q "wheels installed into build/gpu_check/site" "$log" \
    || [ "$(tail -1 "$log")" != "gpu_check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no device); nothing to check" ]; then
  echo "check_gpu_wheels: FAILED: expected the install, then 'no NVIDIA GPU' and exit 2" >&2
  exit 1
fi
if [ "${CPU_RUN:-0}" = 1 ]; then  # the run's imports beyond the import check: every stage, on the CPU
  run_dir=build/check_gpu_wheels-run
  rm -rf "$run_dir"
  start=$(date +%s)
  "${offline[@]}" WANDB_MODE=disabled PYTHONPATH="$PWD/build/gpu_check/site:$PWD" \
    "$PYTHON" -m opd_sao.app.cli run configs/gpu_check.yaml device=cpu trainer.backend=torch --run-dir "$run_dir" \
    > build/check_gpu_wheels-run.log 2>&1 || { tail -20 build/check_gpu_wheels-run.log >&2;
      echo "check_gpu_wheels: FAILED: configs/gpu_check.yaml on the CPU (log build/check_gpu_wheels-run.log)" >&2; exit 1; }
  sed -n '/^stage  /,/^summary:/p' build/check_gpu_wheels-run.log  # per stage: gate verdict, held-out scores
  echo "check_gpu_wheels: configs/gpu_check.yaml ran on the CPU with only torch and $DIR in $(($(date +%s) - start)) s"
fi
echo "check_gpu_wheels: ok: CPython $version installs $(ls "$DIR"/*.whl | wc -l) wheels ($(du -cb "$DIR"/*.whl | tail -1 | cut -f1) bytes) offline; no GPU here"

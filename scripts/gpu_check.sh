#!/usr/bin/env bash
# GPU check: the short quickstart (configs/gpu_check.yaml: sft, reasoning, agent, chat and opd stages) on
# this machine's first GPU, once per trainer setting, with timings and the consistency-gate figures of
# every stage written to OUT. Without an NVIDIA GPU it says so in one line and exits 2.
#
#   scripts/gpu_check.sh [OUT]          # OUT: the report (default docs/gpu_check.txt)
#
#   RUNS="torch-fp32 torch-bf16 deepspeed-bf16"   the settings to run (default: all three)
#   STEP_TIMEOUT=600                               seconds each run may take before it is stopped
#   PYTHON=/path/to/python                         the interpreter (default: .venv, then python3, if its
#                                                  torch sees CUDA; else build/venv-gpu is built from PyPI)
#
# torch-fp32      trainer and engine in float32: the gate holds its default thresholds (1e-3 / 1e-2)
# torch-bf16      trainer.dtype and engine.dtype bfloat16 on the torch backend
# deepspeed-bf16  the DeepSpeed backend (ZeRO-2, bf16) in a world of one, engine in bfloat16
# bf16 rounding moves logprobs by up to ~1e-2, so the bf16 runs gate at 2e-2 (mean) / 2e-1 (p99) and
# the report says so. Exit status: 0 when every run passed, 1 when one failed, 2 without a GPU.
# Time: on 2 CPU cores (device=cpu, a 32-wide model) a run took 2-4 minutes; where one call is capped
# (e.g. 10 minutes), run the settings in separate calls: RUNS=torch-fp32, then RUNS="torch-bf16 ...".
# OUT holds the runs of one call; APPEND=1 adds a call's report to OUT instead of replacing it.
# Everything besides OUT stays under build/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/gpu_check.txt}
WORK=build/gpu_check
RUNS=${RUNS:-torch-fp32 torch-bf16 deepspeed-bf16}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
CONFIG=configs/gpu_check.yaml
STAGES="reasoning agent chat opd"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no device); nothing to check" >&2
  exit 2
fi

has_cuda() { timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python build/venv-gpu/bin/python python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then
    PY=$candidate
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no Python here has a CUDA torch; building build/venv-gpu (CUDA torch and DeepSpeed from PyPI)"
  python3 -m venv build/venv-gpu
  DS_BUILD_OPS=0 timeout 1800 build/venv-gpu/bin/pip install -q --disable-pip-version-check "torch==2.13.0" \
    -e ".[deepspeed]" || { echo "gpu_check: installing into build/venv-gpu failed (no network?); set PYTHON" >&2; exit 2; }
  PY=build/venv-gpu/bin/python
  has_cuda "$PY" || { echo "gpu_check: $PY's torch does not see the GPU (driver / CUDA mismatch?)" >&2; exit 2; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's code, whatever $PY has installed

mkdir -p "$WORK" "$(dirname "$OUT")"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
export WANDB_MODE=disabled

overrides_for() {  # the config overrides of one run setting
  local gate=""
  for stage in $STAGES; do
    gate="$gate stages.$stage.gate.mean_abs_diff=2e-2 stages.$stage.gate.p99_abs_diff=2e-1"
  done
  case "$1" in
    torch-fp32) echo "device=cuda trainer.backend=torch" ;;
    torch-bf16) echo "device=cuda trainer.backend=torch trainer.dtype=bfloat16 engine.dtype=bfloat16$gate" ;;
    deepspeed-bf16) echo "device=cuda trainer.backend=deepspeed trainer.dtype=bfloat16 engine.dtype=bfloat16" \
                         "trainer.deepspeed_config.zero_optimization.stage=2$gate" ;;
    *) echo "gpu_check: unknown run setting $1 (torch-fp32, torch-bf16, deepspeed-bf16)" >&2; return 1 ;;
  esac
}

STAMP=$(date +%Y%m%d-%H%M%S)
RESULTS="$WORK/results-$STAMP.tsv"
: > "$RESULTS"
for run in $RUNS; do
  overrides=$(overrides_for "$run") || exit 2
  run_dir="$WORK/run-$STAMP-$run"
  log="$WORK/$run.log"
  status=ok
  if [[ $run == deepspeed-* ]] && ! timeout 300 "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
    echo "gpu_check: $run skipped: deepspeed is not importable by $PY" | tee "$log"
    printf '%s\tskipped\t0\t0\t%s\n' "$run" "$run_dir" >> "$RESULTS"
    continue
  fi
  echo "gpu_check: $run (log: $log, at most ${STEP_TIMEOUT}s)"
  start=$(date +%s)
  # shellcheck disable=SC2086  # the overrides are separate words
  timeout --kill-after=30 "$STEP_TIMEOUT" "$PY" -m opd_sao.cli run "$CONFIG" $overrides --run-dir "$run_dir" \
    > "$log" 2>&1 || status="failed (exit $?)"
  end=$(date +%s)
  [ "$status" = ok ] || { echo "gpu_check: $run $status; the last lines of $log:" >&2; tail -15 "$log" >&2; }
  printf '%s\t%s\t%s\t%s\t%s\n' "$run" "$status" "$start" "$end" "$run_dir" >> "$RESULTS"
done

timeout 300 "$PY" - "$RESULTS" "$CONFIG" > "$WORK/report.txt" <<'EOF'
import contextlib, io, json, subprocess, sys
from pathlib import Path

import torch

results, config = Path(sys.argv[1]), sys.argv[2]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
try:
    with contextlib.redirect_stdout(io.StringIO()):  # its accelerator banner is not part of the report
        import deepspeed
    ds = deepspeed.__version__
except Exception as err:  # the report still says what ran
    ds = f"not importable ({type(err).__name__})"
print(f"gpu_check: {config} (all five stage kinds) on one GPU, per trainer setting")
print(f"  gpu          {gpu[0] if gpu else '?'}")
print(f"  torch        {torch.__version__} (cuda {torch.version.cuda}); deepspeed {ds}")
failed = 0
for line in results.read_text().splitlines():
    run, status, start, end, run_dir = line.split("\t")
    print(f"\n{run}: {status}" + (f", {int(end) - int(start)} s wall (model build, every stage, every evaluation)"
                                   if status != "skipped" else ""))
    failed += status not in ("ok", "skipped")
    summary = Path(run_dir) / "summary.json"
    if not summary.is_file():
        continue
    print(f"  {'stage':<10} {'kind':<10} {'wall s':>7} {'samples/s':>9} {'gate':>5} {'mean|dlogp|':>11} "
          f"{'p99|dlogp|':>10} {'checks':>6}  eval after")
    for stage in json.loads(summary.read_text())["stages"]:
        gate, train = stage.get("gate") or {}, stage.get("train") or {}
        verdict = "-" if gate.get("passed") is None else ("pass" if gate["passed"] else "FAIL")
        fmt = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
        speed = train.get("samples_per_s")
        print(f"  {stage['name']:<10} {stage['kind']:<10} {stage['wall_s']:>7} "
              f"{'-' if speed is None else f'{speed:.1f}':>9} {verdict:>5} {fmt(gate.get('mean_abs_diff')):>11} "
              f"{fmt(gate.get('p99_abs_diff')):>10} {gate.get('evaluations', '-'):>6}  "
              + " ".join(f"{d}={v}" for d, v in stage["eval_after"].items()))
print("\nbf16 runs gate at mean 2e-2 / p99 2e-1 (bf16 rounding); torch-fp32 at the defaults 1e-3 / 1e-2.")
print(f"summary: {'all runs passed' if not failed else f'{failed} run(s) failed'}")
EOF
if [ "${APPEND:-0}" = 1 ] && [ -f "$OUT" ]; then
  { cat "$OUT"; echo; cat "$WORK/report.txt"; } > "$OUT.tmp"
else
  cp "$WORK/report.txt" "$OUT.tmp"
fi
mv "$OUT.tmp" "$OUT"
cat "$OUT"
grep -q "all runs passed" "$WORK/report.txt"

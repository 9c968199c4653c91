"""Pass rate over seeds of the margin a model-training test depends on (a stand-in for other machines).

A test that trains a model passes on one machine with one seed; another machine's floating-point path moves
the trained model as much as another seed does. So each target below replays the test's margin-bearing part
over `--seeds` seeds and prints one JSON line per seed, then one summary line: `{"target", "passed", "of"}`.

  chat           the chat stage test's reward model (tests/test_chat.py: reward_model_dir) and the chat
                 environment's validity check it must pass at stage start (16 tasks, run seed 1)
                 (a learned judge is no verifier: the check is skipped, reported), and
                 tests/test_chat.py::test_reward_model_ranks_held_out_pairs' accuracies and ranking on the same model
  train_from     tests/test_rewards.py's reward model trained from a preference file (no quality margin asserted)
  sft_loss       tests/test_deepspeed_sft.py's torch reference run (its examples and run seed): the loss falls
                 from the first step to the last and the weights move past 100x the comparison's tolerance (the
                 ZeRO-3 run matches this one to 1e-5, so its outcome is this one's)
  multinode      tests/test_multinode.py's SFT and SAO stages (its own config) on the torch backend in one
                 process, run seed = the seed: the SFT loss falls, the SAO stage sees a reward and a gradient

Tests that take the `train_seed` fixture need no target here: `pytest --train-seeds 20 TEST` runs them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def chat(seed: int, args) -> dict:
    import torch
    from test_chat import TASK, TINY

    from opd_sao.config import TinyModelConfig
    from opd_sao.envs.chat import ChatEnv, train_chat_reward_model
    from opd_sao.envs.chat.reward_model import RewardModel
    from opd_sao.envs.rewards import build_reward
    from opd_sao.envs.validity import check_environment

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rm"
        info = train_chat_reward_model(out, n_pairs=args.pairs, steps=args.steps, seed=seed,
                                       shape=TinyModelConfig(**TINY))
        options = {"judge": "reward_model", "judge_options": {"path": str(out)}}
        report = check_environment("chat", lambda: ChatEnv(**options), n=16, seed=1)
        model = RewardModel(out)
        accuracy = model.accuracy(ChatEnv().preference_pairs("eval", 200, seed=7))
        good, bad = model.score([TASK["prompt"]] * 2, [" aww, i love cats so much~", " cats cats cats cats~"]).tolist()
        judged = build_reward("reward_model", {"path": str(out), "binary": True}).score(
            TASK, " aww, i love cats so much~").score == 1
    return {"validity_ok": report.ok, "validity_skipped": report.skipped,
            "failures": {k: v for k, v in report.failures.items() if v}, "heldout_accuracy": info["heldout_accuracy"],
            "accuracy_seed7": accuracy, "ranks_example": good > bad, "example_margin": good - bad,
            "good_above_threshold": judged, "passed": report.ok and info["heldout_accuracy"] >= 0.8
            and accuracy >= 0.8 and good > bad}


def train_from(seed: int, args) -> dict:
    """tests/test_rewards.py::test_a_reward_model_trained_from_a_file_is_retrained_when_the_file_changes at `seed`."""
    from opd_sao.envs.dataset.preferences import train_from_file

    rows = [{"prompt": f"tell me about topic {i}", "chosen": f"topic {i} is a fine thing to learn about.",
             "rejected": "no."} for i in range(30)]
    with tempfile.TemporaryDirectory() as tmp:
        prefs, out = Path(tmp) / "prefs.jsonl", Path(tmp) / "rm"
        prefs.write_text("".join(json.dumps(r) + "\n" for r in rows))
        first = train_from_file(prefs, out, steps=2, seed=seed)
        again = train_from_file(prefs, out, steps=2, seed=seed)
    return {"passed": first["train_pairs"] > 0 and again == {}}


def sft_loss(seed: int, args) -> dict:
    """tests/test_deepspeed_sft.py's reference (torch) run with its examples and run seed at `seed`."""
    import torch
    from test_deepspeed_sft import WEIGHT_ATOL, _sft_cfg

    from opd_sao.checkpoints import PromptFormat, load_causal_lm, load_tokenizer
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.io.tracking import read_jsonl
    from opd_sao.supervised import run_sft, sft_examples

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.tiny
        tokenizer = load_tokenizer(tiny)
        examples = sft_examples(ENVIRONMENTS.get("arithmetic"), tokenizer, n=40, seed=seed,
                                prompt_format=PromptFormat(tokenizer))
        ref = Path(tmp) / "torch"
        run_sft(tiny, ref / "checkpoint", examples, tokenizer, _sft_cfg(), seed, work_dir=ref)
        losses = [r["loss"] for r in read_jsonl(ref / "sft.jsonl")]
        start, end = (load_causal_lm(d).state_dict() for d in (tiny, ref / "checkpoint"))
        moved = max(float((end[k] - start[k]).abs().max()) for k in end)
    return {"first_loss": losses[0], "last_loss": losses[-1], "loss_drop_rel": 1 - losses[-1] / losses[0],
            "moved": moved, "passed": losses[-1] < losses[0] and moved > 100 * WEIGHT_ATOL}


def multinode(seed: int, args) -> dict:
    """tests/test_multinode.py's `warm` (SFT) and `add` (SAO) stages, torch backend, run seed `seed`."""
    import torch
    from test_multinode import _config

    from opd_sao.app.pipeline import run_pipeline
    from opd_sao.config import parse_config

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.tiny
        cfg = _config(tiny, tiny, "http://127.0.0.1:1")  # the OPD stages (the served teacher) are left out
        cfg.update(seed=seed, stages=cfg["stages"][:2])
        for stage in cfg["stages"]:
            stage.pop("trainer")
        run = Path(tmp) / "run"
        run_pipeline(parse_config(cfg), run, log=lambda m: None)
        read = lambda stage, name: [json.loads(line) for line in
                                    (run / "stages" / stage / name).read_text().splitlines()]
        warm, sao = read("warm", "sft.jsonl"), read("add", "metrics.jsonl")
    rewards = [m["reward_mean"] for m in sao]
    grad = max(m["policy_grad_norm"] for m in sao)
    return {"sft_loss": [warm[0]["loss"], warm[-1]["loss"]], "sao_rewards": rewards, "max_policy_grad_norm": grad,
            "passed": warm[-1]["loss"] < warm[0]["loss"] and sum(rewards) > 0 and grad > 0}


TARGETS = {"chat": chat, "train_from": train_from, "sft_loss": sft_loss, "multinode": multinode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=1500, help="chat: the reward model's training pairs")
    parser.add_argument("--steps", type=int, default=200, help="chat: the reward model's training steps")
    parser.add_argument("--tiny", type=Path, help="sft_loss, multinode: the tests' tiny model, built once here "
                        "if not given (tests/conftest.py: build_tiny)")
    args = parser.parse_args()
    models = tempfile.TemporaryDirectory()
    if args.target in ("sft_loss", "multinode") and args.tiny is None:
        from conftest import build_tiny

        args.tiny = build_tiny(Path(models.name) / "tiny")
    passed = 0
    for seed in range(args.first, args.first + args.seeds):
        row = TARGETS[args.target](seed, args)
        passed += bool(row["passed"])
        print(json.dumps({"seed": seed, **row}), flush=True)
    print(json.dumps({"target": args.target, "passed": passed, "of": args.seeds}))


if __name__ == "__main__":
    main()

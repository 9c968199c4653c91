"""Does a better baseline recover faster when a single choice decides the reward? A three-armed softmax bandit.

The chat online-learning miniature (benchmarks/online_learning.py) decides style with one choice, the
opening word; there SAO and the running mean tie within noise. This benchmark removes everything but
that choice: a policy over three "styles" (softmax of three logits, all equal at the start), batches of
16 single samples, reward 1 for the preferred style (times a 0.95 quality draw), the preference rotating
every 60 steps, REINFORCE with three baselines on the same seeds:

- `running_mean`: the mean of the last 128 rewards (opd_sao.algorithms.RunningMeanBaseline), which
  lags a switch by 8 batches;
- `exact_value`: the policy's true expected reward at that step, i.e. a critic that re-aligns
  instantly and never errs (the best SAO's value model could do as a baseline, lambda = 1);
- `exact_advantage`: Q(style) - V with both exact, in place of reward - baseline: what a perfect critic
  gives through GAE as lambda -> 0 (it also removes the quality draw's noise);
- `none`: no baseline.

Steps to recover are counted as in the chat stage (opd_sao.envs.chat.steps_to_recover: the 5-step mean
batch reward back at 0.3). A baseline never changes the expected gradient; it only changes its
variance. If the baseline mattered for recovery, `exact_value` would beat `running_mean` here, where
nothing else differs. Prints one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from opd_sao.algorithms import RunningMeanBaseline
from opd_sao.envs.chat import STYLES, StyleSchedule, steps_to_recover

BASELINES = ("running_mean", "exact_value", "exact_advantage", "none")
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def run(baseline: str, optimizer: str, lr: float, seed: int, *, batch: int, switch_every: int, steps: int,
        quality: float, window: int) -> list[float]:
    """Mean batch reward per step of one REINFORCE run."""
    gen = torch.Generator().manual_seed(seed)
    schedule = StyleSchedule(STYLES[0], switch_every)
    logits = torch.zeros(len(STYLES), requires_grad=True)
    opt = OPTIMIZERS[optimizer]([logits], lr=lr)
    running = RunningMeanBaseline(window)
    rewards = []
    for step in range(steps):
        preferred = STYLES.index(schedule.style_at(step))
        probs = torch.softmax(logits, 0)
        styles = torch.multinomial(probs.detach(), batch, replacement=True, generator=gen)
        chosen = (styles == preferred).float()
        reward = chosen * (torch.rand(batch, generator=gen) < quality).float()
        value = float(probs[preferred].detach()) * quality
        advantage = {"running_mean": reward - running.value, "exact_value": reward - value,
                     "exact_advantage": chosen * quality - value, "none": reward}[baseline]
        loss = -(advantage * torch.log(probs[styles])).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        running.update(reward)
        rewards.append(float(reward.mean()))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 seeds, Adam at one learning rate (seconds)")
    parser.add_argument("--seeds", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup = {"batch": 16, "switch_every": 60, "steps": 240, "quality": 0.95, "window": 128}
    level, window = 0.3, 5
    settings = [("adam", 0.005), ("adam", 0.01), ("adam", 0.02), ("sgd", 0.1), ("sgd", 0.3), ("sgd", 1.0)]
    if args.quick:
        settings, args.seeds = settings[1:2], 20
    t0 = time.perf_counter()
    schedule = StyleSchedule(STYLES[0], setup["switch_every"])
    switches = schedule.switches(setup["steps"])
    ends = switches[1:] + [setup["steps"]]
    results = {}
    for optimizer, lr in settings:
        row = {}
        for baseline in BASELINES:
            per_switch = [[] for _ in switches]
            for seed in range(args.seeds):
                rewards = run(baseline, optimizer, lr, seed, **setup)
                for i, (s, end) in enumerate(zip(switches, ends)):
                    k = steps_to_recover(rewards, s, end, level, window)
                    per_switch[i].append(end - s if k is None else k)  # censored: the whole phase
            means = [statistics.fmean(v) for v in per_switch]
            row[baseline] = {"mean_steps_to_recover": round(statistics.fmean(means), 2),
                             "per_switch": [round(m, 2) for m in means]}
        results[f"{optimizer} lr={lr}"] = row
    print(json.dumps({"benchmark": "online_bandit", **setup, "level": level, "window_steps": window,
                      "seeds": args.seeds, "results": results, "wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()

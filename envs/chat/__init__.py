"""Chat domain: small-talk prompts, one response, reward = quality x style (docs/design.md §2.6, both binary).

Quality comes from a pluggable judge: any registered reward (envs/rewards.py), `judge: rule` by default
(`judges.py`), or `judge: reward_model` (binary at its threshold), which the environment trains from its own
preference pairs when the judge's `path` holds none.
Style is whether the response is in the user's preferred style, one of three, decided by the opening
word where the model commits to it: cute opens "aww", chuunibyou "behold", classical "verily". (Markers
anywhere in the response, "~" at the end or "doth" in the middle, let RL meet a new style by editing a
tail or splicing a word into the old style's sentence instead of switching: benchmarks/online_learning.py
saw "aww, flowers doth ..." pass as classical, and garbled tails where "~" was the cute marker.)

The preference belongs to the user, not to the task: fixed (`style:`) or, for the online-learning
simulation, rotating cute -> chuunibyou -> classical every `switch_every` trainer steps. The RL
stage hands a training environment `train_step` (the trainer's step count), so the switch follows
training progress, and a run's stage summary reports, per switch, the steps the run needed to get its
rolling batch reward back to `recover_level` (`training_summary`). Outside training (SFT demonstrations, evaluation, validity checks) a task's own
"style" is the preference: train tasks come once per style, so the warm start learns all three
equally and RL has to find the preferred one; eval tasks carry the first preferred style.
"""
from __future__ import annotations

import random
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

from opd_sao.envs.base import Environment, register_env, shuffled
from opd_sao.envs.rewards import build_reward, check_reward
from opd_sao.errors import UsageError

from .judges import words_of

STYLES = ("cute", "chuunibyou", "classical")
RESPONSES = {  # short, so a 2-layer model writes them well; the first word already commits to a style
    "cute": ("aww, i love {t} so much~", "aww, {t} make me happy~", "aww, {t} are so sweet~"),
    "chuunibyou": ("behold! {t} obey me!", "behold the dark {t}!", "behold, {t} of the abyss!"),
    "classical": ("verily, {t} doth please me.", "verily, {t} doth bring joy.", "verily, {t} doth shine."),
}
TOPICS = ("cats", "dogs", "tea", "coffee", "rain", "snow", "music", "stars", "bread", "books", "flowers", "oceans",
          "trains", "cake", "birds", "autumn", "games", "rivers", "cheese", "clouds", "bees", "winter", "apples", "jazz")
PROMPTS = ("user: tell me about {t}.\nbot:", "user: what do you think of {t}?\nbot:", "user: do you like {t}?\nbot:",
           "user: say something about {t}.\nbot:", "user: how do you feel about {t}?\nbot:")
FILLER = "and so on and on we go with more words here".split()


OPENERS = {"aww": "cute", "behold": "chuunibyou", "verily": "classical"}


def style_of(response: str) -> Optional[str]:
    """The style the response's first word opens; None when it opens none."""
    words = words_of(response)
    return OPENERS.get(words[0]) if words else None


class StyleSchedule:
    """The preferred style at a trainer step: `first`, then the next of STYLES every `switch_every` steps (0: never)."""

    def __init__(self, first: str = "cute", switch_every: int = 0):
        if first not in STYLES:
            raise UsageError(f"chat style {first!r} is not one of {list(STYLES)}")
        if switch_every < 0:
            raise UsageError(f"chat switch_every must be >= 0 (got {switch_every})")
        self.first, self.switch_every = first, switch_every

    def style_at(self, step: int) -> str:
        shift = step // self.switch_every if self.switch_every else 0
        return STYLES[(STYLES.index(self.first) + shift) % len(STYLES)]

    def switches(self, steps: int) -> list[int]:
        """Trainer steps (< steps) at which the preferred style changes."""
        return list(range(self.switch_every, steps, self.switch_every)) if self.switch_every else []


def steps_to_recover(rewards: list[float], switch: int, end: int, level: float, window: int,
                     settle: int = 0) -> Optional[int]:
    """Steps after a switch at step `switch` until the mean reward of the last `window` steps first reaches
    `level`: the smallest t - switch + 1 with switch + settle + window - 1 <= t < end. None (censored) when that
    does not happen before `end`. The window starts `settle` steps after the switch: earlier rewards belong to
    the old preference, and so may the first `settle` batches after it (asynchronous rollouts up to
    `max_staleness` versions old were scored before the switch)."""
    for t in range(switch + settle + window - 1, min(end, len(rewards))):
        if sum(rewards[t - window + 1: t + 1]) / window >= level:
            return t - switch + 1
    return None


@register_env("chat")
class ChatEnv(Environment):
    reads_train_step = True  # the RL stage passes train_step: the preference may follow training progress
    reads_device = True  # stages pass the run's device: a reward-model judge scores there

    def __init__(self, judge: str = "rule", judge_options: Optional[dict] = None, style: str = "cute",
                 switch_every: int = 0, recover_level: float = 0.3, recover_window: int = 5,
                 eval_fraction: float = 0.2, train_step: Optional[Callable[[], int]] = None,
                 device: Optional[str] = None):
        if not 0 < recover_level <= 1:
            raise UsageError(f"chat recover_level must be in (0, 1] (got {recover_level})")
        if recover_window < 1:
            raise UsageError(f"chat recover_window must be >= 1 (got {recover_window})")
        self.schedule = StyleSchedule(style, switch_every)
        self.recover_level, self.recover_window = recover_level, recover_window
        self.judge = build_reward(judge, ensure_reward_model(judge, judge_options, device))
        self.stochastic_reward = self.judge.stochastic
        self.eval_fraction, self.train_step = eval_fraction, train_step
        self.task = None

    @classmethod
    def check_options(cls, options: dict) -> None:
        super().check_options(options)
        check_judge(options.get("judge", "rule"), options.get("judge_options"))

    @classmethod
    def for_prompts(cls, options: dict) -> "ChatEnv":
        """With the rule judge: the tasks and prompts do not depend on the judge, and a reward model is not loaded."""
        return cls(**{**options, "judge": "rule", "judge_options": None})

    def _prompts(self, split: str) -> list[tuple[str, int]]:
        """(topic, prompt template) pairs of a split; a stable hash keeps train and eval apart."""
        return [(t, i) for t in TOPICS for i in range(len(PROMPTS))
                if (random.Random(f"chat-{t}-{i}").random() < self.eval_fraction) == (split == "eval")]

    def make_tasks(self, split: str, n: int, seed: int) -> list[dict]:
        styles = STYLES if split == "train" else (self.schedule.first,)
        tasks = [{"id": f"chat-{split}-{t.replace(' ', '_')}-{i}-{s}", "prompt": PROMPTS[i].format(t=t), "topic": t,
                  "style": s} for t, i in self._prompts(split) for s in styles]
        return shuffled(tasks, n, seed)

    def preferred_style(self) -> str:
        if self.train_step is None:
            return self.task["style"]
        return self.schedule.style_at(self.train_step())

    def reset(self, task: dict) -> str:
        self.task = task
        return task["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        quality = self.judge.checked(self.task, action).score
        return "", quality * float(style_of(action) == self.preferred_style()), True

    def training_summary(self, rewards: list[float], settle: int = 0) -> dict:
        """For the stage summary: per style switch, the steps to recover (the default level, 0.3, is about the
        warm start's reward, when the three styles are equally likely); {} when the style never switches.
        `settle`: batches after a switch that may hold rollouts scored before it (see steps_to_recover)."""
        switches = self.schedule.switches(len(rewards))
        if not switches:
            return {}
        ends = switches[1:] + [len(rewards)]
        per_switch = [{"step": s, "from": self.schedule.style_at(s - 1), "to": self.schedule.style_at(s),
                       "phase_steps": end - s,
                       "steps_to_recover": steps_to_recover(rewards, s, end, self.recover_level, self.recover_window,
                                                             settle)}
                      for s, end in zip(switches, ends)]
        return {"style_switches": {"level": self.recover_level, "window": self.recover_window, "settle": settle,
                                   "per_switch": per_switch}}

    def reference_actions(self, task: dict) -> list[str]:
        """A good response in the task's style (one of three phrasings, fixed per task)."""
        phrasing = random.Random(task["id"]).choice(RESPONSES[task["style"]])
        return [" " + phrasing.format(t=task["topic"])]

    def oracle_actions(self, task: dict) -> Optional[list[str]]:
        """The references, held to score 1 only by a judge that is a verifier (the rule judge), not by a learned
        one (`Reward.verifier`)."""
        return self.reference_actions(task) if self.judge.verifier else None

    def preference_pairs(self, split: str, n: int, seed: int) -> list[tuple[str, str, str]]:
        """(prompt, good response, degraded response): what the reward-model judge learns quality from."""
        rng = random.Random(f"pairs-{split}-{seed}")
        tasks = self.make_tasks(split, 10**6, seed)
        pairs = []
        for _ in range(n):
            task = rng.choice(tasks)
            topic = task["topic"]
            chosen = rng.choice(RESPONSES[rng.choice(STYLES)]).format(t=topic)
            pairs.append((task["prompt"], " " + chosen, " " + degrade(chosen, topic, rng)))
        return pairs


def degrade(response: str, topic: str, rng: random.Random) -> str:
    """A plausible bad response: off topic, cut off, repetitive, rambling, or empty."""
    kind = rng.choice(("off_topic", "cut_off", "repetitive", "rambling", "empty"))
    if kind == "off_topic":
        return response.replace(topic, rng.choice([t for t in TOPICS if t != topic]))
    if kind == "cut_off":
        words = response.split()
        return " ".join(words[: rng.randint(1, len(words) - 1)]).rstrip(".!?~,")
    if kind == "repetitive":
        return " ".join([topic] * rng.randint(3, 5)) + response[-1]
    if kind == "rambling":
        return response[:-1] + " " + " ".join(FILLER) + response[-1]
    return rng.choice(("", "...", "~"))


_training_lock = threading.Lock()
REWARD_MODEL_TRAINING = ("train_pairs", "train_steps", "seed")  # judge_options that only shape a missing model


def ensure_reward_model(judge: str, options: Optional[dict], device: Optional[str] = None) -> Optional[dict]:
    """The judge options with the reward-model training keys removed, after training the reward model at
    `path` from this environment's preference pairs when the judge needs one and none is there yet
    (also for a `noisy` judge wrapping a reward model). A reward model runs on `device` unless its
    options name one."""
    options = dict(options or {})
    if judge == "noisy" and options.get("inner") == "reward_model":
        options["inner_options"] = ensure_reward_model("reward_model", options.get("inner_options"), device)
        return options
    if judge != "reward_model" or "path" not in options:
        return options
    training = {key: options.pop(key) for key in REWARD_MODEL_TRAINING if key in options}
    options.setdefault("binary", True)  # quality is good or not (the paper's chat reward is binary)
    if device is not None:
        options.setdefault("device", device)
    with _training_lock:
        if not (Path(options["path"]) / "config.json").is_file():
            train_chat_reward_model(Path(options["path"]), n_pairs=training.get("train_pairs", 3000),
                                    steps=training.get("train_steps", 300), seed=training.get("seed", 0),
                                    device=options.get("device"))
    return options


def check_judge(judge: str, options: Optional[dict], where: str = "judge_options") -> None:
    """Raise ValueError for a judge name or options that ensure_reward_model and build_reward would refuse, without
    training or loading anything."""
    try:
        check_reward(judge, options, also=REWARD_MODEL_TRAINING if judge == "reward_model" else (), where=where)
    except KeyError as err:
        raise UsageError(f"judge: {err.args[0]}") from None
    except ValueError as err:
        raise UsageError(f"judge: {err}") from None
    if judge == "noisy":
        check_judge((options or {}).get("inner", "rule"), (options or {}).get("inner_options"), f"{where}.inner_options")


def train_chat_reward_model(out: Path, *, n_pairs: int = 3000, steps: int = 300, seed: int = 0,
                            shape=None, device: Optional[str] = None) -> dict:
    """Build a tiny backbone on the chat corpus, train a reward model on generated pairs, save it to `out`."""
    from opd_sao.checkpoints import build_tiny_model
    from opd_sao.config import TinyModelConfig

    from .reward_model import train_reward_model

    env = ChatEnv()
    with tempfile.TemporaryDirectory() as tmp:
        init = build_tiny_model(Path(tmp) / "init", env.corpus(), shape or TinyModelConfig(), seed)
        return train_reward_model(init, out, env.preference_pairs("train", n_pairs, seed),
                                  env.preference_pairs("eval", 500, seed + 1), steps=steps, seed=seed,
                                  device=device)

"""`env: reasoning_gym`: tasks from a reasoning-gym procedural generator (`task: basic_arithmetic`), scored strictly
on the final answer by the generator's own `score_answer`.

Splits: reasoning-gym generates item i of a dataset from seed + i, so the train split is items of seeds
[data_seed, data_seed + train_size) and the eval split items of [data_seed + train_size, ... + eval_size): disjoint
seeds. A small generator can still draw one question under two seeds, so an eval item whose question text is in the
train split is dropped (counted: `eval_dropped`).

The final answer of a response is the content of its last `<answer>...</answer>`, else of its last \\boxed{}, else
the whole response (stripped), read after the last verbatim copy of the prompt (envs/answers.py: an echoed
prompt answers nothing). It scores 1 when `score_answer` gives it 1, else 0: reasoning-gym's default partial credit
(the reference's length over the answer's when the answer contains the reference) would pay a response that lists
many numbers, so none is kept. The reference action, for the SFT warm start and the validity oracle, is the item's
`answer` in `<answer>` tags, and task["answer"] holds it bare, as the dataset env's tasks do.

Several generators in one run are several domains: `env: reasoning_gym:basic_arithmetic`, `reasoning_gym:chain_sum`
(the label only names the domain; `task` picks the generator).
"""
from __future__ import annotations

import functools
import json
import re
import string
import threading
from typing import Any, Optional

from pydantic import Field, ValidationError, field_validator

from opd_sao.config import Strict, format_error
from opd_sao.errors import UsageError

from .answers import after_prompt
from .base import ExactAnswerEnv, register_env
from .dataset.rewards import last_boxed

DEFAULT_TEMPLATE = "{question}\nGive only the final answer, as <answer>...</answer>."
MAX_ITEMS = 100_000  # per split: items are generated and held in memory at the first check; a stage draws no more
TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymOptions(Strict):
    """The `env_options` of a reasoning_gym environment."""

    task: Optional[str] = Field(None, description="the reasoning-gym generator: basic_arithmetic, chain_sum, "
                                                  "leg_counting, ... (reasoning_gym.factory.DATASETS)")
    task_options: dict[str, Any] = Field({}, description="the generator's config fields (all but seed and size)")
    train_size: int = Field(1000, ge=1, le=MAX_ITEMS,
                            description="items in the train split (seeds data_seed + 0 .. train_size - 1)")
    eval_size: int = Field(200, ge=1, le=MAX_ITEMS, description="items generated for the eval split, on the seeds "
                                                                "after train's; those whose question is in train are "
                                                                "dropped")
    data_seed: int = Field(0, ge=0, description="the generator's base seed")
    prompt_template: str = Field(DEFAULT_TEMPLATE, description="how a question is shown: {question}, with the "
                                                               "instruction to mark the final answer")

    @field_validator("prompt_template")
    @classmethod
    def _names_question_only(cls, template: str) -> str:
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as err:
            raise ValueError(f"prompt_template {template!r} is not a valid template: {err}") from None
        if names != ["question"]:
            raise ValueError(f"prompt_template {template!r} must name {{question}} once and nothing else")
        return template


def final_answer(response: str) -> tuple[str, bool]:
    """The response's final answer and whether it was marked (<answer> tags or \\boxed{})."""
    tagged = TAGGED.findall(response)
    if tagged:
        return tagged[-1].strip(), True
    boxed = last_boxed(response)
    return (boxed.strip(), True) if boxed is not None else (response.strip(), False)


class Generated:
    """The two splits of one generator configuration, made once per process (environments are made per episode)."""

    def __init__(self, task: str, task_options: dict, train_size: int, eval_size: int, data_seed: int):
        import reasoning_gym

        make = lambda seed, size: reasoning_gym.create_dataset(task, seed=seed, size=size, **task_options)
        self.datasets = {"train": make(data_seed, train_size), "eval": make(data_seed + train_size, eval_size)}
        self.items = {split: dict(enumerate(ds)) for split, ds in self.datasets.items()}
        seen = {item["question"] for item in self.items["train"].values()}
        self.items["eval"] = {i: item for i, item in self.items["eval"].items() if item["question"] not in seen}
        self.counts = {"unmarked": 0, "score_errors": 0, "eval_dropped": eval_size - len(self.items["eval"])}
        self.lock = threading.Lock()

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1


@functools.lru_cache(maxsize=16)
def generated(task: str, task_options_json: str, train_size: int, eval_size: int, data_seed: int) -> Generated:
    return Generated(task, json.loads(task_options_json), train_size, eval_size, data_seed)


@register_env("reasoning_gym")
class ReasoningGymEnv(ExactAnswerEnv):
    corpus_from_options = True  # the tokenizer must see the generator's texts

    def __init__(self, **options):
        self.opts = self.check_options(options)
        self.task: Optional[dict] = None

    @classmethod
    def check_options(cls, options: dict) -> ReasoningGymOptions:
        """The schema, the generator's name, its config (built and validated by reasoning-gym) and both splits
        generated (once per process: the stage reuses them), so a value the generator's checks let through but its
        generation fails on (a 10**6-digit operand, an infinite bound) is one line before any work. The bare
        default (no options: the pipeline's corpus of every class) has no tasks."""
        try:
            opts = ReasoningGymOptions(**options)
        except ValidationError as err:
            raise UsageError(f"reasoning_gym env option {format_error(err)}") from None
        if not options:
            return opts
        if opts.task is None:
            raise UsageError("reasoning_gym env: give `task`, a reasoning-gym generator (e.g. basic_arithmetic)")
        from reasoning_gym.factory import DATASETS

        if opts.task not in DATASETS:
            close = [name for name in sorted(DATASETS) if opts.task in name or name in opts.task][:5]
            raise UsageError(f"reasoning_gym env: no generator {opts.task!r} (reasoning-gym has {len(DATASETS)}"
                             + (f"; close: {', '.join(close)})" if close else ")"))
        reserved = {"seed", "size"} & set(opts.task_options)
        if reserved:
            raise UsageError(f"reasoning_gym env: task_options may not set {sorted(reserved)} (train_size, eval_size "
                             f"and data_seed set them)")
        try:
            config = DATASETS[opts.task][1](**opts.task_options)
            if hasattr(config, "validate"):
                config.validate()
        except (TypeError, ValueError, AssertionError) as err:
            raise UsageError(f"reasoning_gym env: task_options of {opts.task!r}: {err or type(err).__name__}") from None
        try:
            generated(opts.task, json.dumps(opts.task_options, sort_keys=True), opts.train_size, opts.eval_size,
                      opts.data_seed)
        except Exception as err:  # the generator's own code, failing on values its config accepted
            raise UsageError(f"reasoning_gym env: task_options of {opts.task!r}: generating its items failed: "
                             f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
        return opts

    @property
    def generated(self) -> Optional[Generated]:
        o = self.opts
        if o.task is None:
            return None
        return generated(o.task, json.dumps(o.task_options, sort_keys=True), o.train_size, o.eval_size, o.data_seed)

    def all_tasks(self, split: str) -> list[dict]:
        if self.generated is None:
            return []
        tasks = []
        for i, item in self.generated.items[split].items():
            task = {"id": f"{self.opts.task}-{split}-{i}", "prompt": self.opts.prompt_template.format(question=item["question"]),
                    "metadata": {"split": split, "index": i}}
            if item.get("answer") is not None:
                task["answer"] = str(item["answer"])
            tasks.append(task)
        return tasks

    def step(self, action: str) -> tuple[str, float, bool]:
        gen, meta = self.generated, self.task["metadata"]
        answer, marked = final_answer(after_prompt(action, self.task["prompt"]))
        if not marked:
            gen.count("unmarked")
        try:
            score = gen.datasets[meta["split"]].score_answer(answer, gen.items[meta["split"]][meta["index"]])
        except Exception:  # a generator's scorer failing on a malformed answer: that answer is wrong
            gen.count("score_errors")
            score = 0.0
        return "", float(score == 1.0), True

    def reference_actions(self, task: dict) -> Optional[list[str]]:
        return [f"<answer>{task['answer']}</answer>"] if "answer" in task else None

    def training_summary(self, rewards: list[float], settle: int = 0) -> dict:
        """Responses without a marked answer, scorer failures, and the split sizes (eval after dropping repeats)."""
        gen = self.generated
        if gen is None:
            return {}
        return {"reasoning_gym": {"task": self.opts.task, **gen.counts, "train": len(gen.items["train"]),
                                  "eval": len(gen.items["eval"])}}

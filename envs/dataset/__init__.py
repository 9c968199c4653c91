"""`env: dataset`: tasks from your own files, scored by a reward function chosen by name.

Files: JSONL, JSON (one array), Parquet, or a `datasets` save_to_disk directory (`files.py`). Either
`train_path` and `eval_path`, or one `path` whose rows go to the eval split when a stable hash of their id
falls under `eval_fraction`. Field mapping: `prompt_key` (or `messages_key` for a chat-format list of
{role, content}), `answer_key` (the reference answer; for code, the reference solution), `tests_key`
(assert strings, stdin/stdout pairs, or APPS' {"inputs", "outputs"}), `id_key` (default: the row number),
`metadata_keys` (copied into task["metadata"]). A malformed row is skipped, counted and logged as one line
naming the file, row and field, up to `max_bad_rows`; one more refuses the file.

Rewards (any registered one, envs/rewards.py; `rewards.py` here: exact, math, code_tests, reward_model,
judge, python; `constraints.py`: constraints; the chat env's rule and noisy judges work too). A reward that
allows another turn (code_tests) makes the environment multi-turn as the code environment is: each step's reward is the
change in score, the observation names the first failing test, the episode ends when everything passes.

Several dataset domains in one run are told apart by a label: `env: dataset:gsm8k`, `env: dataset:mbpp`.
"""
from __future__ import annotations

import ast
import functools
import heapq
import json
import logging
import string
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional

from pydantic import Field, ValidationError, model_validator

from opd_sao.config import Strict, format_error
from opd_sao.envs.base import Environment, register_env
from opd_sao.envs.rewards import REWARDS, build_reward, check_reward
from opd_sao.errors import UsageError

from . import constraints as constraint_rewards  # noqa: F401 (registers the constraints reward)
from . import rewards as dataset_rewards  # noqa: F401 (importing it registers the dataset rewards)
from .files import BadRow, DatasetError, field, iter_rows, stable_fraction

logger = logging.getLogger(__name__)

_reported: set[tuple[str, int]] = set()  # malformed rows already logged in this process


class DatasetOptions(Strict):
    """The `env_options` of a dataset environment."""

    path: Optional[str] = Field(None, description="one file or directory holding both splits (split by eval_fraction)")
    train_path: Optional[str] = Field(None, description="the train split's file (with eval_path, instead of path)")
    eval_path: Optional[str] = Field(None, description="the eval split's file (with train_path, instead of path)")
    eval_fraction: float = Field(0.2, gt=0, lt=1, description="share of `path`'s rows held out, by a hash of the id")
    prompt_key: str = Field("prompt", description="field with the prompt text")
    messages_key: Optional[str] = Field(None, description="field with a chat-format prompt: a list of {role, content}")
    answer_key: str = Field("answer", description="field with the reference answer (for code: the reference solution)")
    tests_key: str = Field("tests", description="field with the tests (asserts, stdin/stdout pairs, APPS dict)")
    id_key: str = Field("id", description="field with a unique task id; rows without it are numbered")
    metadata_keys: list[str] = Field([], description="fields copied into task['metadata'] (required in every row)")
    prompt_template: str = Field("{prompt}", description="how the prompt text is shown; {prompt} and metadata keys")
    chat_template: Optional[str] = Field(None, description="a local HF tokenizer directory whose chat template "
                                                           "renders the prompt (as one user message when plain text)")
    max_bad_rows: int = Field(0, ge=0, description="malformed rows skipped (and counted) before a file is refused")
    reward: str = Field("exact", description="a registered reward (envs/rewards.py): exact, math, code_tests, "
                                             "reward_model, judge, python, constraints, rule, noisy, or a plugin's")
    reward_options: dict[str, Any] = Field({}, description="keyword options of the reward")

    @model_validator(mode="after")
    def _template_names_known_fields(self) -> "DatasetOptions":
        """`prompt_template` may name {prompt} and metadata keys only: no positions ({0}, {}), no attributes or
        items ({prompt.x}, {prompt[0]}), which `str.format` would raise on (or evaluate) row by row."""
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None]
        except ValueError as err:
            raise UsageError(f"prompt_template {self.prompt_template!r} is not a valid template: {err}") from None
        allowed = {"prompt", *self.metadata_keys}
        bad = [name for name in names if name not in allowed]
        if bad:
            raise UsageError(f"prompt_template {self.prompt_template!r} names {{{bad[0]}}}; it may name only "
                             f"{{prompt}} and metadata_keys {self.metadata_keys}")
        return self

    @model_validator(mode="after")
    def _keys_and_fraction_used(self) -> "DatasetOptions":
        """Field names a row can have (not empty), metadata keys once each and not `prompt` (the template's own
        name: formatting would get it twice, a TypeError on every row), and `eval_fraction` only where it splits
        (with `path`; separate train and eval files would ignore it)."""
        keys = {"prompt_key": self.prompt_key, "messages_key": self.messages_key, "answer_key": self.answer_key,
                "tests_key": self.tests_key, "id_key": self.id_key}
        empty = [name for name, key in keys.items() if key is not None and not key.strip()]
        empty += [f"metadata_keys[{i}]" for i, key in enumerate(self.metadata_keys) if not key.strip()]
        if empty:
            raise UsageError(f"{empty[0]}: a field name is needed, not an empty string")
        repeated = sorted({key for key in self.metadata_keys if self.metadata_keys.count(key) > 1})
        if repeated:
            raise UsageError(f"metadata_keys: {repeated[0]!r} is listed twice")
        if "prompt" in self.metadata_keys:
            raise UsageError("metadata_keys: 'prompt' is prompt_template's name for the prompt "
                             "text; give the prompt's field as prompt_key")
        if "eval_fraction" in self.model_fields_set and not self.path:
            raise UsageError("eval_fraction: it splits `path`'s rows; with train_path and "
                             "eval_path the eval split is eval_path's (leave eval_fraction out)")
        return self

    def files(self) -> dict[str, str]:
        """split -> file; one file for both splits when `path` is given."""
        if self.path and not (self.train_path or self.eval_path):
            return {"train": self.path, "eval": self.path}
        if self.train_path and self.eval_path and not self.path:
            return {"train": self.train_path, "eval": self.eval_path}
        raise UsageError("dataset env: give `path` (split by eval_fraction) or both `train_path` and `eval_path`")


@functools.cache
def _chat_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"dataset env: the tokenizer at {path!r} has no chat template (leave chat_template unset "
                         f"to show prompts as plain 'role: text' lines)")
    return tokenizer


def render_messages(messages: list[dict], chat_template: Optional[str]) -> str:
    """A chat prompt as text: the tokenizer's chat template with the generation prompt, else plain lines."""
    if chat_template:
        return _chat_tokenizer(chat_template).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def vacuous(test: str) -> str:
    """Why an assert-style test tests nothing ("" when it tests something): empty, not Python, or only `pass`,
    constants and asserts of constants, which any program passes."""
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return f"is not valid Python ({type(err).__name__})"
    constant = lambda node: isinstance(node, ast.Constant)
    if all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and constant(s.value))
           or (isinstance(s, ast.Assert) and constant(s.test)) for s in body):
        return "is empty or vacuous (it runs none of the program: any program would pass it)"
    return ""


def parse_tests(path: Path, number: int, key: str, value: Any) -> dict:
    """Assert strings -> {"kind": "asserts"}; stdin/stdout pairs or APPS' {"inputs", "outputs"} (also as a JSON
    string) -> {"kind": "io"}."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict) and isinstance(value.get("inputs"), list) and isinstance(value.get("outputs"), list):
        if len(value["inputs"]) == len(value["outputs"]) > 0:
            return {"kind": "io", "inputs": [str(i) for i in value["inputs"]],
                    "outputs": [str(o) for o in value["outputs"]]}
    elif isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        for i, test in enumerate(value):
            why = vacuous(test)
            if why:
                raise BadRow(f"{path}: row {number}: field {key!r}: test {i + 1} {why}")
        return {"kind": "asserts", "asserts": list(value)}
    elif isinstance(value, list) and value and all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in value):
        return {"kind": "io", "inputs": [str(t["input"]) for t in value], "outputs": [str(t["output"]) for t in value]}
    raise BadRow(f"{path}: row {number}: field {key!r} must be a non-empty list of assert strings, of "
                 f"{{input, output}} pairs, or {{inputs: [...], outputs: [...]}}")


@register_env("dataset")
class DatasetEnv(Environment):
    corpus_from_options = True  # the tokenizer must see the files' texts

    def __init__(self, **options):
        self.opts = self.check_options(options)
        self.reward_name = self.opts.reward
        reward_cls = REWARDS.get(self.reward_name)
        self.needs = set(reward_cls.needs) | set(self.opts.reward_options.get("needs", ()))
        self.slow_steps = reward_cls.slow or bool(self.opts.reward_options.get("slow", False))
        self.stochastic_reward = reward_cls.stochastic
        self.task, self.score = None, 0.0
        self.has_files = bool(options)  # only the bare default (the pipeline's corpus of every class) has none
        if self.has_files:
            self.opts.files()

    @classmethod
    def check_options(cls, options: dict) -> DatasetOptions:
        """The options schema, the reward's name (an unknown one is named with the registered ones) and that the
        named files exist; none is read, so the pipeline can call it for every stage before any work."""
        try:
            opts = DatasetOptions(**options)
        except ValidationError as err:
            raise UsageError(f"dataset env option {format_error(err)}") from None
        check_reward(opts.reward, opts.reward_options)
        if options:  # the bare default (the pipeline's corpus of every class) names no file
            for path in opts.files().values():
                if not Path(path).exists():
                    raise DatasetError(f"dataset file {path!r} does not exist")
            if opts.chat_template and not Path(opts.chat_template).is_dir():
                raise DatasetError(f"dataset env: chat_template {opts.chat_template!r} is not a directory")
        return opts

    @classmethod
    def data_files(cls, options: dict) -> list[str]:
        return sorted(set(cls.check_options(options).files().values())) if options else []

    def data_problems(self) -> list[str]:
        """Empty files and, with separate train and eval files, ids or prompts in both (a held-out score would
        count trained tasks)."""
        if not self.has_files:
            return []
        files, problems, seen = self.opts.files(), [], {}
        for split in ("train", "eval") if files["train"] != files["eval"] else ("train",):
            tasks = list(self.scan(split, {}))
            if not tasks:
                problems.append(f"{files[split]} has no usable rows")
            seen[split] = ({t["id"] for t in tasks}, {t["prompt"] for t in tasks})
        if len(seen) == 2:
            for what, i in (("ids", 0), ("prompts", 1)):
                shared = seen["train"][i] & seen["eval"][i]
                if shared:
                    shown = ", ".join(repr(x[:40]) for x in sorted(shared)[:3])
                    problems.append(f"{files['train']} and {files['eval']} share {len(shared)} task {what} ({shown})")
        return problems

    # ------------------------------------------------------------------------------------------ tasks
    @property
    def reward(self):
        return build_reward(self.reward_name, self.opts.reward_options)

    def _task(self, path: Path, number: int, row: Any, seen: set) -> dict:
        o = self.opts
        if isinstance(row, BadRow):
            raise row
        if not isinstance(row, dict):
            raise BadRow(f"{path}: row {number}: not an object (got {type(row).__name__})")
        task_id = row.get(o.id_key)
        task_id = f"{path.stem}-{number}" if task_id is None else str(task_id)
        if task_id in seen:
            raise BadRow(f"{path}: row {number}: duplicate id {task_id!r} (field {o.id_key!r})")
        task: dict[str, Any] = {"id": task_id}
        metadata = {key: field(path, number, row, key, object) for key in o.metadata_keys}
        if o.messages_key:
            messages = field(path, number, row, o.messages_key, list)
            if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in messages):
                raise BadRow(f"{path}: row {number}: field {o.messages_key!r} must be a non-empty list of "
                             f"{{role, content}} strings")
            task["messages"] = messages
            task["prompt"] = render_messages(messages, o.chat_template)
        else:
            prompt = field(path, number, row, o.prompt_key, str)
            text = o.prompt_template.format(prompt=prompt, **metadata)  # its names are checked with the options
            task["prompt"] = render_messages([{"role": "user", "content": text}], o.chat_template) \
                if o.chat_template else text
        answer = field(path, number, row, o.answer_key, (str, int, float), required="answer" in self.needs)
        if answer is not None:
            task["answer"] = str(answer)
            if "answer" in self.needs and not task["answer"].strip():
                raise BadRow(f"{path}: row {number}: field {o.answer_key!r} is empty (an empty reference answer "
                             f"would make an empty response score 1)")
        if "tests" in self.needs or row.get(o.tests_key) is not None:
            task["tests"] = parse_tests(path, number, o.tests_key, field(path, number, row, o.tests_key, (list, dict, str)))
        task["metadata"] = metadata
        seen.add(task_id)
        return task

    def scan(self, split: Optional[str], counts: Optional[dict] = None) -> Iterator[dict]:
        """The split's tasks (None: every task of the train file), streamed in file order; malformed rows are
        skipped up to max_bad_rows, and logged once each, or counted in `counts` when given."""
        files = self.opts.files()
        path = Path(files[split or "train"])
        one_file = files["train"] == files["eval"]
        seen: set = set()
        bad = 0
        for number, row in iter_rows(path):
            try:
                task = self._task(path, number, row, seen)
            except BadRow as err:
                bad += 1
                if bad > self.opts.max_bad_rows:
                    raise DatasetError(f"{err}; refusing {path}: more than max_bad_rows={self.opts.max_bad_rows} "
                                       f"malformed rows") from None
                if counts is not None:  # the caller reports them
                    counts["bad_rows"] = bad
                    counts.setdefault("examples", []).append(str(err))
                elif (str(path), number) not in _reported:
                    _reported.add((str(path), number))
                    logger.warning("dataset env: skipped %s", err)
                continue
            if counts is not None:
                counts["rows"] = counts.get("rows", 0) + 1
            if split is None or not one_file or (stable_fraction(task["id"]) < self.opts.eval_fraction) == (split == "eval"):
                yield task

    def make_tasks(self, split: str, n: int, seed: int) -> list[dict]:
        """Up to n tasks of the split in a seeded order (a seeded hash of the id), holding at most n at a time."""
        if not self.has_files:
            return []
        order = lambda task: stable_fraction(f"{seed}:{task['id']}")
        return heapq.nsmallest(n, self.scan(split), key=order)

    # ---------------------------------------------------------------------------------------- episode
    def reset(self, task: dict) -> str:
        self.task, self.score = task, 0.0
        return task["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        reward = self.reward
        verdict = reward.checked(self.task, action)
        delta, self.score = verdict.score - self.score, verdict.score
        done = not reward.multi_turn or verdict.score >= 1.0
        return ("" if done else verdict.feedback), delta, done

    def where(self, task: dict) -> str:
        """The task's file and row (found by reading the files again: only for an error message)."""
        for split_file in dict.fromkeys(self.opts.files().values()):
            path, seen = Path(split_file), set()
            for number, row in iter_rows(path):
                try:
                    if self._task(path, number, row, seen)["id"] == task["id"]:
                        return f"task {task['id']!r} ({path} row {number})"
                except BadRow:
                    continue
        return super().where(task)

    def reference_actions(self, task: dict) -> Optional[list[str]]:
        return [task["answer"]] if task.get("answer") else None

    def oracle_actions(self, task: dict) -> Optional[list[str]]:
        return self.reference_actions(task) if self.reward.verifier else None

    def noop_action(self, task: dict) -> str:
        return "pass" if "tests" in self.needs else ""

    def corpus(self, n: int = 2000) -> list[str]:
        """The train split's prompts and references, and the observations the reward writes."""
        texts = []
        for task in self.make_tasks("train", n, seed=0):
            texts.append(task["prompt"])
            texts.extend(self.reference_actions(task) or [])
        return texts + (REWARDS.get(self.reward_name).feedback_examples() if texts else [])

    def training_summary(self, rewards: list[float], settle: int = 0) -> dict:
        """The reward's counters (judge failures, math timeouts, sandbox errors) and the data's (rows read, malformed
        rows skipped under max_bad_rows, tasks per split) for the stage summary."""
        stats = self.reward.stats()
        return {**({"reward": {"name": self.reward_name, **stats}} if stats else {}), "data": self.data_report()}

    def data_report(self) -> dict:
        """Rows read, malformed rows skipped, and tasks per split."""
        report = {}
        for split in ("train", "eval"):
            counts: dict = {"rows": 0, "bad_rows": 0}
            report[split] = sum(1 for _ in self.scan(split, counts))
            report[f"{split}_file_rows"], report[f"{split}_bad_rows"] = counts["rows"], counts["bad_rows"]
        return report


def inspect_file(path: str, options: dict, n: int = 3) -> tuple[str, int]:
    """What `opd-sao data inspect` prints: rows, malformed rows, fields with their types, and the first n prompts
    as the environment renders them (with the chat template when one is given; a tokenizer without one is said);
    and the number of malformed rows. Without a `reward` option no field beyond the prompt is required (the
    judge reward needs none)."""
    lines, fields, rows = [], Counter(), 0
    for _, row in iter_rows(path):
        rows += 1
        if isinstance(row, dict):
            fields.update(f"{key}: {type(value).__name__}" for key, value in row.items())
    if "reward" not in options:  # nothing is scored here: the judge reward, never built, requires no field
        options = {"reward": "judge", "reward_options": {"base_url": "", "model": ""}, **options}
    options = {**options, "path": path, "max_bad_rows": rows}
    if options.get("chat_template"):
        try:
            _chat_tokenizer(options["chat_template"])
        except ValueError as err:
            lines.append(f"note: {err}; the prompts below are plain text")
            options.pop("chat_template")
    counts: dict = {"rows": 0, "bad_rows": 0}
    tasks = [task for i, task in enumerate(DatasetEnv(**options).scan(None, counts)) if i < n]
    lines.insert(0, f"{path}: {rows} rows, {counts['bad_rows']} malformed under this mapping")
    lines[1:1] = [f"  {example}" for example in counts.get("examples", [])[:3]]
    lines.append("fields (rows that have them): " + ", ".join(f"{f} ({c})" for f, c in sorted(fields.items())))
    for task in tasks:
        lines.append(f"--- prompt of {task['id']} ---\n{task['prompt']}")
        if task.get("answer"):
            lines.append(f"--- its reference ---\n{task['answer']}")
    return "\n".join(lines), counts["bad_rows"]

"""Writes the sample data files of this folder (run from the repository root: python examples/data/make_samples.py).

Three files in the shapes people bring, simple enough for the 2-layer tiny model to learn on a CPU, and large
enough (about 300 rows each) that the held-out split (a fifth, by a hash of the id) has some 60 tasks, so a
stage's held-out score moves by more than its sampling noise:
  gsm8k.jsonl       GSM8K shape: {"question", "answer"} with the worked answer ending in `#### n` (no id field)
  mbpp.jsonl        MBPP shape: {"task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list"}
  chat_prefs.jsonl  preference pairs: {"id", "prompt", "chosen", "rejected"}
configs/byo_data.yaml trains on them. Deterministic: the same files every time.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
NAMES = ("tom", "ann", "sam", "mia", "leo", "eva")
THINGS = ("apples", "cards", "pens", "books", "coins", "stamps")
QUESTIONS = ("{n} has {a} {t} and gets {b} more. how many {t} does {n} have?",
             "there are {a} {t} in a box and {b} {t} on a desk. how many {t} are there?")
FUNCTIONS = (("add{b}", "x+{b}"), ("times{a}", "x*{a}"), ("times{a}_plus{b}", "x*{a}+{b}"), ("minus{b}", "x-{b}"),
             ("times{a}_minus{b}", "x*{a}-{b}"))
TOPICS = ("cats", "dogs", "tea", "rain", "snow", "music", "stars", "bread", "books", "flowers", "trains", "cake",
          "birds", "games", "rivers", "cheese", "boats", "hills", "soup", "films", "maps", "clocks", "bees", "kites",
          "lakes", "trees", "socks", "jazz", "chess", "fish", "rice", "moths", "owls", "pies", "ships", "bells",
          "coats", "frogs", "honey", "lamps", "mice", "nuts", "pears", "poems", "roads", "salt", "seeds", "shoes",
          "songs", "tents", "toys", "wine", "wolves", "clouds", "hats", "milk", "bikes", "plums", "caves", "waves")
PROMPTS = ("user: tell me about {t}.\nbot:", "user: do you like {t}?\nbot:", "user: what about {t}?\nbot:",
           "user: any thoughts on {t}?\nbot:")


def gsm8k(rng: random.Random, n: int = 300) -> list[dict]:
    rows, seen = [], set()
    while len(rows) < n:
        a, b = rng.randint(1, 5), rng.randint(1, 5)
        question = QUESTIONS[len(rows) % 2].format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
        if question not in seen:  # no question in both splits
            seen.add(question)
            rows.append({"question": question, "answer": f"{a}+{b}={a + b}\n#### {a + b}"})
    return rows


def mbpp(rng: random.Random, n: int = 300) -> list[dict]:
    specs = sorted({(name.format(a=a, b=b), expr.format(a=a, b=b))
                    for name, expr in FUNCTIONS for a in range(2, 10) for b in range(1, 20)})
    rows = []
    for name, expr in rng.sample(specs, n):
        tests = [f"assert {name}({x}) == {eval(expr, {'x': x})}" for x in rng.sample(range(0, 10), 3)]
        rows.append({"task_id": 601 + len(rows), "text": f"write a function {name}(x) that returns {expr}.",
                     "code": f"def {name}(x):\n    return {expr}", "test_list": tests, "test_setup_code": "",
                     "challenge_test_list": []})
    return rows


def chat_prefs(rng: random.Random) -> list[dict]:
    rows = []
    for topic in TOPICS:
        for j, prompt in enumerate(PROMPTS):
            chosen = f" i like {topic} a lot."
            other = rng.choice([t for t in TOPICS if t != topic])
            rejected = rng.choice((f" i like {other} a lot.", " i like", f" {topic} {topic} {topic}", " ...", " no."))
            rows.append({"id": f"pref-{topic}-{j}", "prompt": prompt.format(t=topic), "chosen": chosen,
                         "rejected": rejected})
    return rows


# ---- configs/smollm2.yaml's agent and chat data: tasks a 135M instruct model partly solves, >= 200 held out
# function families: (name, argument, what the prompt says it returns, the expression, test inputs)
NUMBER_INPUTS, WORD_INPUTS = (-3, 0, 4, 7, 12, 25, 38), ("banana", "", "tree", "rain")
LIST_INPUTS, DIGIT_INPUTS = ([1, 2, 3], [5, 12, 30], [40, 7, 22, 18], [], [9, 27]), (0, 7, 45, 123, 9081)
# one in three tasks a formula to transcribe (SmolLM2 passed 36 of 40 such tasks greedily), the rest a condition,
# a remainder, a filter or the digits of a number to work out
FAMILIES = (
    ("add{b}", "x", "x+{b}", "x+{b}", NUMBER_INPUTS), ("minus{b}", "x", "x-{b}", "x-{b}", NUMBER_INPUTS),
    ("times{a}_plus{b}", "x", "x*{a}+{b}", "x*{a}+{b}", NUMBER_INPUTS),
    ("above{b}_times{a}", "x", "x times {a} if x is greater than {b}, otherwise x", "x*{a} if x > {b} else x",
     NUMBER_INPUTS),
    ("mod{a}_plus{b}", "x", "the remainder of x divided by {a}, plus {b}", "x % {a} + {b}", NUMBER_INPUTS),
    ("distance_to{b}", "x", "the absolute difference between x and {b}", "abs(x-{b})", NUMBER_INPUTS),
    ("count_above{b}", "xs", "the number of elements of the list xs greater than {b}", "sum(1 for v in xs if v > {b})",
     LIST_INPUTS),
    ("sum_above{b}", "xs", "the sum of the elements of the list xs greater than {b}", "sum(v for v in xs if v > {b})",
     LIST_INPUTS),
    ("digit_sum_plus{b}", "x", "the sum of the decimal digits of x (x >= 0) plus {b}", "sum(int(d) for d in str(x))+{b}",
     DIGIT_INPUTS),
    ("remove_{c}", "s", "the string s with every letter '{c}' removed", "s.replace('{c}', '')", WORD_INPUTS),
    ("count_{c}", "s", "the number of times the letter '{c}' appears in the string s", "s.count('{c}')", WORD_INPUTS),
)


def functions(rng: random.Random) -> list[dict]:
    """Python function tasks in MBPP's shape, one per (family, parameters), with three asserts on fixed inputs."""
    specs = {name.format(a=a, b=b, c=c): (arg, say.format(a=a, b=b, c=c), expr.format(a=a, b=b, c=c), inputs)
             for name, arg, say, expr, inputs in FAMILIES for a in range(2, 10) for b in range(1, 30) for c in "aeinrt"}
    rows = []
    for name in rng.sample(sorted(specs), len(specs)):
        arg, say, expr, inputs = specs[name]
        tests = [f"assert {name}({x!r}) == {eval(expr, {arg: x})!r}" for x in rng.sample(inputs, 3)]
        rows.append({"task_id": f"fn-{name}", "text": f"Write a Python function {name}({arg}) that returns {say}.",
                     "code": f"def {name}({arg}):\n    return {expr}", "test_list": tests})
    return rows


TASKS = ("Write a few sentences about {t}.", "Tell me about {t}.", "Describe {t} to a child.",
         "What do you like about {t}?")
SENTENCES = ("{t} can make a quiet day feel better.", "many people enjoy {t} with their friends.",
             "i often think about {t} in the morning.", "there is always something new to learn about {t}.",
             "thinking of {t} brings back long summer days.", "a small thing like {t} can bring real joy.")
KEYWORDS = ("lantern", "garden", "window", "river", "pocket", "candle", "meadow", "journey", "whisper", "harbor")
AVOID = ("very", "really", "also", "just", "good")
OPENINGS, ENDINGS = ("My answer:", "Here it is.", "In short"), ("That is all.", "Thank you.", "Is there anything else?")
RULES = {"lowercase": "Use only lowercase letters.", "include": 'Include the word "{word}".',
         "exclude": 'Do not use the word "{word}".', "no_commas": "Do not use any commas.",
         "max_words": "Answer in at most {n} words.", "min_words": "Answer in at least {n} words.",
         "start_with": 'Start your answer with "{phrase}".', "end_with": 'End your answer with "{phrase}".',
         "bullets": 'Answer with exactly {n} bullet points, each on its own line starting with "- ".',
         "quoted": "Wrap your whole answer in double quotes."}


def _constraint(rng: random.Random, kind: str, lines: list[str]) -> dict:
    """One constraint with its drawn word or phrase; an included word gets a sentence in the reference `lines`."""
    if kind in ("include", "exclude"):
        word = rng.choice(KEYWORDS if kind == "include" else AVOID)
        if kind == "include":
            lines.insert(rng.randrange(len(lines) + 1), f"it reminds me of a {word}.")
        return {"kind": kind, "word": word}
    if kind in ("start_with", "end_with"):
        return {"kind": kind, "phrase": rng.choice(OPENINGS if kind == "start_with" else ENDINGS)}
    return {"kind": kind}


def _reference(rng: random.Random, topic: str, shape: str, kinds: list[str]) -> tuple[list[dict], str]:
    """The constraints of one row and a reference answer that meets them (word limits set from its length)."""
    lines = [s.format(t=topic) for s in rng.sample(SENTENCES, 3 if shape == "bullets" else rng.randint(2, 3))]
    constraints = [_constraint(rng, kind, lines) for kind in kinds]
    lines = [line[0].upper() + line[1:] for line in lines]
    text = "\n".join(f"- {line}" for line in lines) if shape == "bullets" else " ".join(lines)
    phrases = {c["kind"]: c["phrase"] for c in constraints if "phrase" in c}
    text = " ".join(p for p in (phrases.get("start_with"), text, phrases.get("end_with")) if p)
    if "lowercase" in kinds:
        text = text.lower()
        for c in constraints:
            c.update({"phrase": c["phrase"].lower()} if "phrase" in c else {})
    words = len(text.split())
    for c in constraints:
        c.update({"bullets": {"n": len(lines)}, "max_words": {"n": words + rng.randint(3, 12)},
                  "min_words": {"n": max(5, words - rng.randint(0, 6))}}.get(c["kind"], {}))
    return constraints, f'"{text}"' if shape == "quoted" else text


def instructions(rng: random.Random, n: int = 1000) -> list[dict]:
    """IFEval-style rows for `reward: constraints`: a request about a topic with two verifiable constraints (a shape:
    bullets, quoted, start or end phrase, or plain with an included word; and one of lowercase, include, exclude, no
    commas, word limits: with 2-3, SmolLM2 met all of them on 2 of 40 held-out rows), and a reference answer. Every
    row has a constraint that an empty answer fails, so the validity check's no-op and echo probes score 0, and so
    does the request itself (both checked here)."""
    from opd_sao.envs.dataset.constraints import failed_constraints

    rows, seen = [], set()
    while len(rows) < n:
        topic, shape = rng.choice(TOPICS), rng.choice(("plain", "bullets", "quoted", "start_with", "end_with"))
        extra = rng.sample(("lowercase", "include", "exclude", "no_commas", "max_words", "min_words"), 1)
        if shape == "plain" and "include" not in extra:
            extra.append("include")
        kinds = [*extra, shape] if shape != "plain" else extra
        if {"max_words", "min_words"} <= set(kinds) or (shape == "bullets" and "min_words" in kinds):
            continue
        constraints, text = _reference(rng, topic, shape, kinds)
        prompt = " ".join([rng.choice(TASKS).format(t=topic), *(RULES[c["kind"]].format(**c) for c in constraints)])
        if prompt in seen or not failed_constraints(constraints, prompt):  # the request itself must not pass
            continue
        assert not failed_constraints(constraints, text) and failed_constraints(constraints, ""), (prompt, text)
        seen.add(prompt)
        rows.append({"id": f"if-{len(rows)}", "prompt": prompt, "constraints": constraints, "answer": text})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write_jsonl(HERE / "gsm8k.jsonl", gsm8k(random.Random(0)))
    write_jsonl(HERE / "mbpp.jsonl", mbpp(random.Random(1)))
    write_jsonl(HERE / "chat_prefs.jsonl", chat_prefs(random.Random(2)))
    write_jsonl(HERE / "functions.jsonl", functions(random.Random(3)))
    write_jsonl(HERE / "instructions.jsonl", instructions(random.Random(4)))

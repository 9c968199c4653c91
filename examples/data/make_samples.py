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


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write_jsonl(HERE / "gsm8k.jsonl", gsm8k(random.Random(0)))
    write_jsonl(HERE / "mbpp.jsonl", mbpp(random.Random(1)))
    write_jsonl(HERE / "chat_prefs.jsonl", chat_prefs(random.Random(2)))

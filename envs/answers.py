"""What counts as a final answer, shared by the math reward, the reasoning_gym environment and the validity probes.

A policy can game a verifier that evaluates expressions: `66 - 8`, or the prompt `Calculate 66 - 8.` itself, is
"equal" to 58 for math-verify. Two rules close that:

- An operation left undone is no answer (`unevaluated`): the final expression of a text (its last run of plain
  numbers joined by `+ - * / × ÷ \\times \\cdot \\div`, parentheses allowed) holds an operation between two
  numbers. Not operations: a leading sign (`-5`), one plain fraction of integers that is not a whole number
  (`1/2`, `\\frac{6}{8}`; `116/2` is a division left to do), and anything with a letter, a power, a subscript or
  a LaTeX command between (`2^{10}`, `2x+1`, `\\sqrt{2}/2`): MATH-style answers are written so. Words (`66 minus
  8`) are not read.
- What a response copies of its prompt is not its answer (`after_prompt`): the answer is looked for in what follows
  the last verbatim copy of the prompt, so echoing the prompt answers nothing.
"""
from __future__ import annotations

import re
from typing import Optional

# a LaTeX fraction of two integers, read as a/b; any other braced command argument, power or subscript is not a
# plain number (it becomes a letter, which no number touches)
FRACTION = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")
NOT_PLAIN = re.compile(r"\\[a-zA-Z]+\{[^{}]*\}|[\^_]\{[^{}]*\}|[\^_]\w+")
OPERATORS = {r"\times": "*", r"\cdot": "*", "×": "*", "·": "*", r"\div": "/", "÷": "/", "−": "-",
             r"\left": "", r"\right": "", "{": "(", "}": ")"}
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?!\w|\.\d)")
LINK = re.compile(r"[-+*/][-+]?")  # one binary operator between two numbers, then perhaps the second's sign


def normalised(text: str) -> str:
    """LaTeX as plain arithmetic: integer fractions as a/b, operators as `* / -`, braces as parentheses, and every
    other command, power or subscript as the letter E, so that the numbers inside it are not plain numbers."""
    text = FRACTION.sub(r"(\1/\2)", text)
    while NOT_PLAIN.search(text):  # innermost first: \sqrt{\frac{a}{b}} is one letter in the end
        text = NOT_PLAIN.sub("E", text)
    for latex, plain in OPERATORS.items():
        text = text.replace(latex, plain)
    return text


def expressions(text: str) -> list[str]:
    """Every maximal run of plain numbers joined by operators in `text` (LaTeX normalised), in order, each with
    its leading sign and its parentheses balanced; a lone number is a run of one."""
    text = normalised(text)
    runs: list[list[re.Match]] = []
    for match in NUMBER.finditer(text):
        gap = text[runs[-1][-1].end():match.start()] if runs else ""
        if runs and LINK.fullmatch(re.sub(r"[\s()]", "", gap)):
            runs[-1].append(match)
        else:
            runs.append([match])
    out = []
    for run in runs:
        sign = re.search(r"(?<![\w).])[-+]\s*$", text[:run[0].start()])  # a leading sign belongs to the run
        span = text[sign.start() if sign else run[0].start():run[-1].end()]
        missing = span.count(")") - span.count("(")
        out.append("(" * max(missing, 0) + span + ")" * max(-missing, 0))
    return out


def is_operation(expression: str) -> bool:
    """The run holds an operation left to do: two numbers or more, other than one non-whole fraction a/b."""
    numbers = NUMBER.findall(expression)
    if len(numbers) < 2:
        return False
    fraction = re.fullmatch(r"\(?\s*[-+]?\s*\(?\s*(\d+)\s*/\s*(\d+)\s*\)?\s*\)?", expression.strip())
    if len(numbers) == 2 and fraction:
        numerator, denominator = int(fraction[1]), int(fraction[2])
        return denominator == 0 or numerator % denominator == 0
    return True


def unevaluated(text: str) -> bool:
    """The text's final expression (its last run) is an operation left undone: as an answer it is no answer."""
    runs = expressions(text)
    return bool(runs) and is_operation(runs[-1])


def prompt_expression(prompt: str) -> Optional[str]:
    """The arithmetic expression a prompt asks about (its longest run that is an operation, the last of equals),
    which the validity check's restate probe answers with; None when the prompt holds none."""
    found = [run for run in expressions(prompt) if is_operation(run)]
    return max(reversed(found), key=lambda run: len(NUMBER.findall(run))) if found else None


def after_prompt(response: str, prompt: Optional[str]) -> str:
    """What follows the last verbatim copy of the prompt in the response (the whole response when there is none)."""
    prompt = (prompt or "").strip()
    if not prompt or prompt not in response:
        return response
    return response.rsplit(prompt, 1)[1]

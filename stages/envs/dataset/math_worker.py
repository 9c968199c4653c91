"""The math reward's checker process: reads {"prediction", "reference", "timeout_s"} lines on stdin, writes
{"equal": bool} lines. It is a separate process because math-verify's per-verification timeout uses
signal.alarm, which works only in a main thread (rollouts score on worker threads), and because a sympy
call stuck past every timeout can then be killed. Standalone: run as a script, it imports only math-verify.
"""
import json
import sys


def equivalent(prediction: str, reference: str, timeout_s: int) -> bool:
    """math-verify's equivalence of two texts (a $-wrapped final answer, or a whole response)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(reference, extraction_config=config, parsing_timeout=timeout_s)
    pred = parse(prediction, extraction_config=config, parsing_timeout=timeout_s)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout_s))


if __name__ == "__main__":
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the run, which ends this process itself

    logging.disable(logging.WARNING)  # math-verify logs every unparsable answer
    for line in sys.stdin:
        job = json.loads(line)
        try:
            equal = equivalent(job["prediction"], job["reference"], job["timeout_s"])
        except Exception:  # an answer math-verify cannot handle is not equal
            equal = False
        sys.stdout.write(json.dumps({"equal": equal}) + "\n")
        sys.stdout.flush()

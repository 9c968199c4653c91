"""The math reward's checker, the handler of a worker process (`worker_loop.py`): answers {"prediction",
"reference", "timeout_s"} jobs with {"equal": bool}. It is a separate process because math-verify's per-verification timeout uses
signal.alarm, which works only in a main thread (rollouts score on worker threads), and because a sympy
call stuck past every timeout can then be killed. Standalone: loaded by path, it imports only math-verify.
"""


def equivalent(prediction: str, reference: str, timeout_s: int) -> bool:
    """math-verify's equivalence of two texts (a $-wrapped final answer, or a whole response)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(reference, extraction_config=config, parsing_timeout=timeout_s)
    pred = parse(prediction, extraction_config=config, parsing_timeout=timeout_s)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout_s))


def handler():
    import logging

    logging.disable(logging.WARNING)  # math-verify logs every unparsable answer

    def handle(job: dict) -> dict:
        try:
            return {"equal": equivalent(job["prediction"], job["reference"], job["timeout_s"])}
        except Exception:  # an answer math-verify cannot handle is not equal
            return {"equal": False}

    return handle

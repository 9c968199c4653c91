"""The math reward's checker, the handler of a worker process (`worker_loop.py`): answers {"prediction",
"reference", "cpu_s"} jobs with {"equal": bool}, plus "over_cpu": true for a check that ran out of CPU time.

The limit is this process's CPU time, never the wall clock, so a loaded machine slows a check but cannot change its
verdict. math-verify's own limits are signal.alarm (wall-clock), and a parse it times out reads as "nothing to
compare": on a busy machine a correct answer (`\\boxed{2\\sqrt{2}}` against `\\sqrt{8}`) scored 0 without a word.
Here math-verify runs without them; a check past `cpu_s` CPU seconds is interrupted (ITIMER_PROF), and one stuck
in C code, where no Python handler runs, is killed by the kernel at about twice that (RLIMIT_CPU's soft limit:
SIGXCPU). It is a separate process because the kill takes the process, and signals reach only a main thread
(rollouts score on worker threads). Standalone: loaded by path, it imports only math-verify.
"""
import logging
import math
import resource
import signal


class OverCpu(BaseException):
    """A check past its CPU time. Not an Exception: math-verify reads those as "not equal" and carries on."""


def equivalent(prediction: str, reference: str) -> bool:
    """math-verify's equivalence of two texts (a $-wrapped final answer, or a whole response), with no timer."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(reference, extraction_config=config, parsing_timeout=None)
    pred = parse(prediction, extraction_config=config, parsing_timeout=None)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def handler():
    logging.disable(logging.WARNING)  # math-verify logs every unparsable answer
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGXCPU kill leaves no core file
    equivalent("$\\sqrt{8}$", "$2\\sqrt{2}$")  # the first check builds math-verify's parsers: at start-up, not in a job

    def over_cpu(signum, frame):
        raise OverCpu

    signal.signal(signal.SIGPROF, over_cpu)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def handle(job: dict) -> dict:
        kill_at = math.ceil(cpu_seconds() + 2 * job["cpu_s"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (kill_at if hard == resource.RLIM_INFINITY else min(kill_at, hard), hard))
        signal.setitimer(signal.ITIMER_PROF, job["cpu_s"])
        try:
            return {"equal": equivalent(job["prediction"], job["reference"])}
        except OverCpu:
            return {"equal": False, "over_cpu": True}
        except Exception:  # an answer math-verify cannot handle is not equal
            return {"equal": False}
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))

    return handle

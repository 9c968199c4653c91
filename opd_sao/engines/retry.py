"""The one retry policy of opd-sao's network calls, in two forms: urllib3's `Retry` mounted on a `requests.Session`
(the SGLang-API clients, the fleet, weight sync, the served teacher), and `call_with_retries` around a call the
HTTP layer cannot see into (the LLM judge, `judge` reward in envs/dataset/rewards.py: the `openai` client,
and a reply without a score is a failed try too). Both wait backoff_s, 2x, 4x, ... between tries.

Transient failures are tried again with exponential backoff: a connection refused or reset, a connect
timeout, and the statuses a proxy or an overloaded server answers with (502/503/504; from a router also
500, which sglang-router answers when the worker it chose failed). A read timeout is not: another one would
be spent the same way. Every method is retried (POST included): SGLang's weight calls and /generate are
safe to send again once the server did not take them; callers whose request must not be repeated (a
broadcast's receive) pass `retries=0`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ReadTimeoutError
from urllib3.util.retry import Retry

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_STATUS = frozenset({502, 503, 504})
ROUTER_TRANSIENT_STATUS = TRANSIENT_STATUS | {500}


class _LoggedRetry(Retry):
    """urllib3's Retry, saying at INFO level what it sends again (urllib3 itself logs status retries at DEBUG),
    and never retrying a read timeout (a reset connection is a read error it does retry)."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        if isinstance(error, ReadTimeoutError):  # another try would wait as long again
            raise error
        retry = super().increment(method, url, response, error, _pool, _stacktrace)
        why = f"HTTP {response.status}" if response is not None and error is None else type(error).__name__
        where = f"{_pool.host}:{_pool.port}" if _pool is not None else ""
        log.info("%s %s%s failed (%s), sent again in %.1f s", method, where, url, why, retry.get_backoff_time())
        return retry


def retry_policy(retries: int, backoff_s: float, statuses=TRANSIENT_STATUS) -> Retry:
    """`retries` more tries after the first, waiting about backoff_s, 2x, 4x, ... between them."""
    return _LoggedRetry(total=retries, connect=retries, read=retries, status=retries, other=0, redirect=0,
                 backoff_factor=backoff_s, status_forcelist=sorted(statuses), allowed_methods=None,
                 raise_on_status=False, respect_retry_after_header=False)


def retrying_session(retries: int, backoff_s: float, statuses=TRANSIENT_STATUS, pool: int = 64) -> requests.Session:
    """A keep-alive session whose every request follows `retry_policy` (`pool`: connections kept per host)."""
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry_policy(retries, backoff_s, statuses), pool_connections=4,
                          pool_maxsize=pool)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def call_with_retries(call: Callable[[], T], retries: int, backoff_s: float, max_wait_s: float,
                      on_failed_try: Callable[[Exception], None] = lambda err: None) -> tuple[T, int]:
    """`call()` with `retries` more tries after the first, any exception a failed try (`on_failed_try` sees each),
    waiting backoff_s, 2x, 4x, ... or what the server asked for in the error's `Retry-After` (seconds; an HTTP date
    backs off instead), at most max_wait_s. Returns (the result, the tries it took); raises the last try's error."""
    for attempt in range(retries + 1):
        try:
            return call(), attempt + 1
        except Exception as err:
            on_failed_try(err)
            if attempt == retries:
                raise
            time.sleep(_wait_s(err, backoff_s * 2 ** attempt, max_wait_s))


def _wait_s(error: Exception, backoff_s: float, max_wait_s: float) -> float:
    response = getattr(error, "response", None)
    asked = response.headers.get("retry-after") if response is not None else None
    try:
        wait = float(asked) if asked is not None else backoff_s
    except ValueError:
        wait = backoff_s
    return min(max(wait, 0.0), max_wait_s)

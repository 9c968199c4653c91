"""Load-aware routing over several SGLang-API rollout servers (the seeds' long/short trajectory scheduling).

Each request goes to the live server with the fewest estimated tokens in flight (`est_tokens`, else
`max_new_tokens`), so long and short trajectories spread evenly instead of round-robin piling long ones
onto one server. A server that stops answering (after retries and a failed health check) is taken out and
the requests it held are sent again to the others; none is lost. It rejoins when its health check
recovers (see `HTTPEngine`). A weight sync is written once and loaded by every live server, each confirming
the new `weight_version` (see `HTTPEngine`). A URL may itself be an external router (sglang-router):
this one then balances across the URLs, and weights go to the workers behind them.
"""
from __future__ import annotations

from .http import HTTPEngine, _Server


class Router(HTTPEngine):
    def __init__(self, urls: list[str], *, checkpoint=None, weights_dir=None, max_inflight: int = 32,
                 timeout: float = 600.0, down_timeout: float = 60.0, probe_s: float = 1.0, workers=(),
                 weight_sync: str = "disk", sync_address: str = "127.0.0.1"):
        if not urls:
            raise ValueError("the router needs at least one rollout server URL (engine.urls)")
        self._setup(list(urls), checkpoint=checkpoint, weights_dir=weights_dir, max_inflight=max_inflight,
                    timeout=timeout, down_timeout=down_timeout, probe_s=probe_s, workers=workers,
                    weight_sync=weight_sync, sync_address=sync_address)

    def _pick(self, servers: list[_Server]) -> _Server:
        return min(servers, key=lambda s: (s.load, s.inflight, self._servers.index(s)))

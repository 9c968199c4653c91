"""Fleet routing policies: which live rollout server a request goes to, chosen by `engine.routing`.

A policy is a registered function `policy(servers, order) -> server`: `servers` are the live ones the request may
go to (a generation: those with a free slot; a prompt to score: any), `order` every server that generates, in
`engine.urls` order (then the workers behind routers). A server carries `client.url`, `load` (estimated tokens
in flight), `inflight` (requests in flight), `requests` and `tokens` (served so far), `slots`. A policy is
called under the fleet's lock: it must return at once. A new policy is one decorated function (a plugin's
included).
"""
from __future__ import annotations

from typing import Callable

from opd_sao.registry import Registry

RoutingPolicy = Callable[[list, list], object]
ROUTINGS: Registry[RoutingPolicy] = Registry("routing policy")
register_routing = ROUTINGS.register


@register_routing("least_loaded")
def least_loaded(servers: list, order: list):
    """The server with the fewest estimated tokens in flight (then fewest requests, then fleet order): long and
    short trajectories spread evenly instead of piling up round-robin."""
    return min(servers, key=lambda s: (s.load, s.inflight, order.index(s)))

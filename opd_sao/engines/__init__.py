from opd_sao.errors import UsageError

from .base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from .embedded import EmbeddedEngine

__all__ = ["GenerationRequest", "GenerationResult", "RolloutEngine", "SamplingParams", "EmbeddedEngine"]


def _client_options(cfg) -> dict:
    return {"api_key": cfg.api_key, "admin_api_key": cfg.admin_api_key}


def check_engine(cfg, nucleus: bool = False, model_path: str = "tiny") -> None:
    """Before any work: the embedded engine can batch `model_path`'s layers (its config only); an http fleet
    answers, every router in it has workers (no weights move), and with `nucleus` (a stage samples with top_p < 1)
    the servers those requests go to (behind a router: its workers, directly) return the renormalised sampling
    logprobs. The weight-sync mode (and its options) and the routing policy are checked here, not in the config
    schema: the config sits below the engines."""
    from .routing import ROUTINGS
    from .weight_sync import WEIGHT_SYNCS

    if cfg.weight_sync not in WEIGHT_SYNCS:
        raise UsageError(f"engine.weight_sync {cfg.weight_sync!r}: use one of {', '.join(WEIGHT_SYNCS.names())}")
    WEIGHT_SYNCS.get(cfg.weight_sync).parse_options(cfg.weight_sync_options)
    if cfg.routing not in ROUTINGS:
        raise UsageError(f"engine.routing {cfg.routing!r}: use one of {', '.join(ROUTINGS.names())}")
    if cfg.kind == "embedded" and model_path != "tiny":
        from opd_sao.model_import import model_config

        from .embedded import check_batchable

        check_batchable(model_config(model_path))
    if cfg.kind == "http":
        from .fleet import discover_fleet

        if not cfg.urls:
            raise UsageError("engine.kind http needs engine.urls (the rollout servers, e.g. opd-sao serve or SGLang)")
        targets, workers = discover_fleet(cfg.urls, cfg.workers, timeout=30.0, **_client_options(cfg))
        if nucleus:
            from .http import SGLangClient

            routed = any(is_router for _, is_router in targets)
            for url in workers if routed else [client.url for client, _ in targets]:  # as Fleet._targets sends
                SGLangClient(url, 30.0, **_client_options(cfg)).check_sampling_mask()


def build_engine(cfg, checkpoint, tokenizer, seed: int, device=None, attn_implementation: str = "eager"
                 ) -> RolloutEngine:
    """The rollout engine a config asks for, loaded with `checkpoint` at policy version 0.

    `device`: the run's device when `cfg.device` (engine.device) does not override it. `attn_implementation`
    (model.attn_implementation, the trainer's too): the embedded engine's attention; servers use their own.
    """
    if cfg.kind == "embedded":
        from opd_sao.checkpoints import load_causal_lm
        from opd_sao.devices import resolve_device

        model = load_causal_lm(checkpoint, cfg.dtype, resolve_device(cfg.device or device), attn_implementation)
        return EmbeddedEngine(model, eos_id=tokenizer.eos_token_id,
                              pad_id=tokenizer.pad_token_id, max_batch=cfg.max_batch, seed=seed,
                              deterministic=cfg.deterministic, overlap=cfg.overlap, own_forward=cfg.own_forward)
    if cfg.kind == "http":
        from .fleet import Fleet
        from .weight_sync import SyncSettings

        if not cfg.urls:
            raise UsageError("engine.kind http needs engine.urls (the rollout servers, e.g. opd-sao serve or SGLang)")
        sync = SyncSettings(address=cfg.weight_sync_address, bucket_bytes=int(cfg.weight_sync_bucket_mb * (1 << 20)),
                            group_timeout_s=cfg.weight_sync_timeout_s,
                            broadcast_timeout_s=cfg.weight_sync_broadcast_timeout_s,
                            drain_timeout_s=cfg.weight_sync_drain_timeout_s, options=cfg.weight_sync_options)
        return Fleet(cfg.urls, checkpoint=checkpoint, weights_dir=cfg.weights_dir, max_inflight=cfg.max_batch,
                     workers=cfg.workers, weight_sync=cfg.weight_sync, sync=sync, routing=cfg.routing,
                     partial_rollouts=cfg.partial_rollouts, **_client_options(cfg))
    raise NotImplementedError(f"engine kind {cfg.kind!r} is not available yet")

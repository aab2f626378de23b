"""`rlhf promote`, `rlhf serving status|stop|ensure` and `rlhf canary`: the registry's champion and what serves."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from flows.launch import flow_module, run_flow, run_plain_flow, serving_state_dir


def promote_command(args, cfg) -> int:
    from tasks.registry import RegistryError, promote
    from tasks.tracking import tracking_client

    try:
        p = promote(tracking_client(cfg), args.version, args.by, args.reason, force=args.force,
                    name=cfg.tracking.registered_model)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if p.changed:
        print(f"{cfg.tracking.registered_model} v{p.version} is now the champion "
              f"(previous: {'v' + p.previous if p.previous else 'none'})")
    else:
        print(f"{cfg.tracking.registered_model} v{p.version} already is the champion")
    if args.deploy:
        flows, log = flow_module("flows.serving", args, cfg)
        return run_plain_flow(flows.deploy_champion_flow, log, config_path=args.config, overrides=args.overrides)
    return 0


def serving_command(args, cfg) -> int:
    from rlhf_core.serving import server
    from rlhf_core.serving.state import deploy_under_way

    state_dir = serving_state_dir(cfg)
    if args.action == "stop":  # the recorded server's whole process group, its leader alive or not
        print(server.stop_serving(state_dir))
        return 0
    if args.action == "ensure":
        return _ensure_serving(args, cfg, state_dir)
    current, deploying = server.current_endpoint(state_dir), deploy_under_way(state_dir)
    if current is None:
        print("; ".join(str(x) for x in ("nothing is serving", deploying, server.find_orphans(state_dir)) if x))
        return 1
    healthy = server.health(current.url)
    champion, why = _registry_champion(cfg)
    print(json.dumps({**current.to_dict(), "healthy": healthy, "champion": champion}, indent=2))
    if deploying:
        print(deploying, file=sys.stderr)
    if champion is None:
        print(f"could not compare with the registry's champion: {why}", file=sys.stderr)
    elif champion != current.version:
        print(f"serving {current.served_model_name}, but the registry's champion is v{champion}: "
              f"`rlhf deploy` serves the champion; if v{current.version} should serve, "
              f"`rlhf promote {current.version}` makes the registry say so", file=sys.stderr)
        return 4 if healthy else 1
    return 0 if healthy else 1


def _ensure_serving(args, cfg, state_dir: Path) -> int:
    """`rlhf serving ensure`: what `serving_plan` says, for `make demo-loop` from any state."""
    from rlhf_core.serving import server
    from tasks.deploy import serving_plan
    from tasks.registry import RegistryError, champion_version
    from tasks.tracking import tracking_client

    current = server.current_endpoint(state_dir)
    serving = current.version if current is not None and server.health(current.url) else None
    try:  # what serves goes on whatever the registry says
        champion = None if serving else champion_version(tracking_client(cfg), cfg.tracking.registered_model)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    plan = serving_plan(serving, champion)
    print(plan.message)
    if plan.action == "deploy":
        flows, log = flow_module("flows.serving", args, cfg)
        return run_plain_flow(flows.deploy_champion_flow, log, config_path=args.config, overrides=args.overrides)
    if plan.action == "demo":
        flows, log = flow_module("flows.pipeline", args, cfg)
        return run_flow(flows.rlhf_pipeline, log, cfg=cfg, config_path=args.config, overrides=args.overrides)
    return 0


def _registry_champion(cfg) -> tuple[str | None, str]:
    """(the version of `tracking.registered_model` with alias champion, "") or (None, why it is unknown)."""
    from tasks.registry import CHAMPION, by_alias
    from tasks.tracking import tracking_client

    try:
        version = by_alias(tracking_client(cfg), CHAMPION, cfg.tracking.registered_model)
    except Exception as e:  # noqa: BLE001 - the status of what serves must not depend on the registry
        return None, f"{type(e).__name__}: {e}"
    return (str(version.version), "") if version is not None else (None, f"no version of {cfg.tracking.registered_model} is champion")


def canary_command(args, cfg) -> int:
    """`rlhf canary start VERSION | status | decide | promote | roll-back`."""
    from rlhf_core.serving.errors import ServingError
    from tasks.canary import canary_call, end_canary, start_canary
    from tasks.registry import RegistryError

    try:
        if args.action == "start":
            if not args.version:
                print("error: rlhf canary start VERSION: name the version", file=sys.stderr)
                return 2
            canary = start_canary(cfg, args.version)
            print(f"v{canary.endpoint.version} serves {canary.share:g} of the users as a canary beside "
                  f"v{canary.champion_version} at {canary.endpoint.url}")
            return 0
        canary, decision = canary_call(cfg)
        if args.action == "status":
            print(json.dumps({"canary": canary.endpoint.version, "champion": canary.champion_version,
                              "share": canary.share, "call": decision.action, "ratings": decision.ratings,
                              "reason": decision.reason}, indent=2))
            return 0
        action = {"decide": decision.action, "promote": "promote", "roll-back": "roll_back"}[args.action]
        if action == "continue":
            print(f"the canary goes on: {decision.reason}")
            return 0
        ended = end_canary(cfg, action, args.by, args.reason)
    except (RegistryError, ServingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"canary v{ended.version}: {ended.action}; v{ended.serving} serves every user ({ended.reason})")
    return 0

"""The MLflow model registry: versions, the `challenger` / `champion` aliases, promotion and
the rollback bookkeeping.

The registry is the source of truth for what should serve: `models:/<name>@champion`, where
`name` is the config's `tracking.registered_model` (`POLICY` by default; its reward models go
to `tracking.registered_reward_model`, `REWARD_MODEL` by default). What is recorded, so that a person in the MLflow UI and the rollback flow agree:

- A version that passed the gates carries `gate.passed=true` and the gate report; only such
  a version is ever given `challenger` by the pipeline.
- Promoting a version (`promote`) moves `champion` to it and tags it with
  `previous_champion` (the version it replaced), `promoted_by`, `promoted_at` and
  `promotion_reason`. A promotion done by hand in the MLflow UI has no such tag; the
  deploy flow fills `previous_champion` in from what was serving (see `tasks.deploy`).
  Who may be promoted is `check_promotion`'s rule: not a version the gates rejected, nor one
  a rollback moved away from (tag `rolled_back_by_incident`), unless forced; forcing past a
  rollback takes a reason. What a forced promotion overrode is appended to `promotion_reason`.
- A rollback is an incident: the registered model carries the tag `incident.<id>` with a
  JSON record (from, to, reason, requested_by, status). It is written `moving` before the
  alias moves, `moved` once it has, and `completed` once the target serves, so a rollback
  killed at any point and asked again finishes the same move (never a second one), asking
  again after a failed redeploy only redeploys, and asking again for a completed incident
  does nothing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlflow
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

POLICY = "policy"  # the default of tracking.registered_model
REWARD_MODEL = "reward-model"  # the default of tracking.registered_reward_model
CHALLENGER = "challenger"
CHAMPION = "champion"
_INCIDENT_ID = re.compile(r"^[A-Za-z0-9_.\-:]{1,120}$")


class RegistryError(RuntimeError):
    """A registry request that cannot be carried out (unknown version, nothing to roll back to)."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def register_model_version(
    client: MlflowClient, name: str, run_id: str, artifact_path: str, tags: dict[str, str], description: str = ""
) -> str:
    """Create (if needed) the registered model `name` and add `runs:/<run_id>/<artifact_path>`
    as a new version carrying `tags` (lineage). Returns the version number as a string.

    Idempotent: when `name` already has a version from that source (a stage killed after
    registering, then run again), that version is returned, with `tags` set on it."""
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "already exists" not in str(exc).lower() and exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"runs:/{run_id}/{artifact_path}"
    for existing in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if existing.source == source:
            for key, value in tags.items():
                client.set_model_version_tag(name, existing.version, key, value)
            return str(existing.version)
    version = client.create_model_version(
        name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=tags, description=description
    )
    return str(version.version)


def by_alias(client: MlflowClient, alias: str, name: str = POLICY) -> ModelVersion | None:
    """The version `alias` points at, or None (no such alias, or no such registered model)."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def champion_version(client: MlflowClient, name: str = POLICY) -> str | None:
    """The champion's version number, or None when `name` or its champion does not exist. Unlike
    `by_alias`, a store that cannot be read raises: "there is no champion" is never a guess."""
    try:
        return str(client.get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):  # no model; no such alias
            return None
        raise RegistryError(f"cannot read {name}@{CHAMPION} from the registry: {exc}") from exc


def get_version(client: MlflowClient, version: str, name: str = POLICY) -> ModelVersion:
    """A version by number or by alias (`challenger`, `champion`); RegistryError if unknown."""
    if not version.isdigit():
        found = by_alias(client, version, name)
        if found is None:
            raise RegistryError(f"{name}: no version has the alias {version!r}")
        return found
    try:
        return client.get_model_version(name, version)
    except MlflowException:
        raise RegistryError(f"{name}: no version {version}") from None


@dataclass(frozen=True)
class Promotion:
    version: str
    previous: str | None  # the champion it replaced; None for the first champion
    changed: bool  # False when the version already was the champion


_ANY = object()


@dataclass(frozen=True)
class PromotionCheck:
    refusal: str | None  # why the version may not become the champion; None: it may
    overridden: tuple[str, ...] = ()  # what `force` overrode, recorded in `promotion_reason`


def check_promotion(
    name: str, version: str, tags: dict[str, str], rollback: dict | None, *, force: bool, reason: str | None
) -> PromotionCheck:
    """May `version` (carrying `tags`) become the champion? Pure, for the table-driven tests.

    Refused: a version the gates rejected (`gate.passed=false`), unless `force`; a version a
    rollback moved away from (`rolled_back_by_incident`; `rollback` is that incident's record,
    or None if it cannot be read), unless `force` with a `reason`, which is then recorded.
    """
    overridden = []
    if tags.get("gate.passed") == "false":
        if not force:
            return PromotionCheck(
                f"the gates did not pass {name} v{version} ({tags.get('gate.status', 'rejected')}: "
                f"{tags.get('gate.reasons', 'see its gate report')}); promote it anyway with force")
        overridden.append("a gate rejection")
    incident = tags.get("rolled_back_by_incident")
    if incident:
        record = rollback or {}
        what = (f"{name} v{version} was rolled back (incident {incident}"
                + "".join(f", {record[k]}" for k in ("requested_at", "reason") if record.get(k)) + ")")
        if not force:
            return PromotionCheck(f"{what}; promote it again only on purpose: "
                                  f"`rlhf promote {version} --force --reason TEXT` records why")
        if not (reason or "").strip():
            return PromotionCheck(f"{what}; a forced promotion of it needs a reason (`--reason TEXT`), "
                                  "recorded on the version")
        overridden.append(f"the rollback of incident {incident}")
    return PromotionCheck(None, tuple(overridden))


def promote(
    client: MlflowClient, version: str, requested_by: str, reason: str | None, *, force: bool = False,
    name: str = POLICY, expected_champion: str | None | object = _ANY,
) -> Promotion:
    """Make `version` the champion and record the one it replaces.

    Refuses what `check_promotion` refuses: a rejected or rolled-back version unless `force`
    (a person may overrule the gates or a rollback; a rollback only with a `reason`), and that
    is recorded in `promotion_reason`. With `expected_champion` (a version, or None for none),
    refuses unless the champion is still that one: a run evaluated against it must not replace
    another run's promotion unseen. Promoting the champion again changes nothing.
    """
    target = get_version(client, version, name)
    current = by_alias(client, CHAMPION, name)
    if current is not None and current.version == target.version:
        _drop_challenger(client, name, target.version)  # a retried registration may have set it again
        return Promotion(str(target.version), target.tags.get("previous_champion") or None, changed=False)
    incident = target.tags.get("rolled_back_by_incident")
    check = check_promotion(name, str(target.version), target.tags,
                            incident_record(client, incident, name) if incident else None, force=force, reason=reason)
    if check.refusal is not None:
        raise RegistryError(check.refusal)
    previous = None if current is None else str(current.version)
    _check_champion(previous, expected_champion, target.version, name)
    forced = f" (forced past {' and '.join(check.overridden)})" if check.overridden else ""
    for key, value in {
        "previous_champion": previous or "",
        "promoted_by": requested_by,
        "promoted_at": now_iso(),
        "promotion_reason": (reason or "no reason given") + forced,
    }.items():
        client.set_model_version_tag(name, target.version, key, value)
    now = by_alias(client, CHAMPION, name)  # MLflow has no compare-and-set: narrow the window
    _check_champion(None if now is None else str(now.version), previous, target.version, name)
    client.set_registered_model_alias(name, CHAMPION, target.version)
    _drop_challenger(client, name, target.version)
    return Promotion(str(target.version), previous, changed=True)


def _drop_challenger(client: MlflowClient, name: str, version: str) -> None:
    """The champion is no challenger: drop the alias if it points at `version`."""
    challenger = by_alias(client, CHALLENGER, name)
    if challenger is not None and challenger.version == version:
        client.delete_registered_model_alias(name, CHALLENGER)


def _check_champion(actual: str | None, expected: str | None | object, version: str, name: str) -> None:
    if expected is _ANY or actual == expected:
        return
    def v(x):
        return "none" if x is None else f"v{x}"
    raise RegistryError(
        f"not promoting {name} v{version}: champion is {v(actual)}, not {v(expected)} as expected (another run or "
        f"a person moved it meanwhile); evaluate v{version} against the new champion (`rlhf evaluate {version}`) "
        "and promote it then")


# -- rollback --------------------------------------------------------------------------------


def incident_key(incident: str) -> str:
    if not _INCIDENT_ID.match(incident):
        raise RegistryError(
            f"incident id {incident!r}: use 1-120 letters, digits, '_', '-', '.' or ':' (an alert fingerprint or ticket id)"
        )
    return f"incident.{incident}"


def incident_record(client: MlflowClient, incident: str, name: str = POLICY) -> dict | None:
    """The recorded handling of `incident`, or None if it was never asked for."""
    try:
        tags = client.get_registered_model(name).tags
    except MlflowException:
        return None
    raw = tags.get(incident_key(incident))
    return None if raw is None else json.loads(raw)


def record_incident(client: MlflowClient, incident: str, record: dict, name: str = POLICY) -> None:
    client.set_registered_model_tag(name, incident_key(incident), json.dumps(record, sort_keys=True))


@dataclass(frozen=True)
class RollbackPlan:
    incident: str
    from_version: str | None
    to_version: str
    action: str  # "move" (alias and redeploy), "redeploy" (alias already moved), "none" (done before)
    record: dict


def plan_rollback(
    current: str | None, previous_of_current: str | None, to_version: str | None, existing: dict | None, incident: str
) -> tuple[str, str | None, str | None]:
    """Which rollback to do: (action, from, to). Pure, for the table-driven tests.

    `existing` is the incident's record if it was asked for before. A completed incident is
    not acted on again; a `moved` one (the redeploy failed) is redeployed to its recorded
    target. Otherwise the champion moves to `to_version`, or to the version it replaced.
    """
    if existing is not None:
        if existing.get("status") == "completed":
            return "none", existing.get("from"), existing.get("to")
        if existing.get("status") == "moving":  # killed around the alias move: finish that move
            if current not in (existing.get("from"), existing.get("to")):
                raise RegistryError(
                    f"rollback for incident {incident} was interrupted moving champion from v{existing.get('from')} "
                    f"to v{existing.get('to')}, and champion is now v{current}: someone moved it since; "
                    "check the registry and roll back with a new incident id if needed")
            return "move", existing.get("from"), existing.get("to")
        return "redeploy", existing.get("from"), existing.get("to")
    if current is None:
        raise RegistryError(f"rollback for incident {incident}: there is no champion to roll back")
    target = to_version or previous_of_current
    if not target:
        raise RegistryError(
            f"rollback for incident {incident}: champion v{current} has no recorded previous champion; "
            "name the version to return to"
        )
    if target == current:
        raise RegistryError(f"rollback for incident {incident}: v{target} already is the champion")
    return "move", current, target


def start_rollback(
    client: MlflowClient, incident: str, reason: str, requested_by: str, to_version: str | None = None, name: str = POLICY
) -> RollbackPlan:
    """Record the incident and move `champion` back (unless this incident was handled before)."""
    existing = incident_record(client, incident, name)
    current = by_alias(client, CHAMPION, name)
    action, frm, to = plan_rollback(
        None if current is None else str(current.version),
        None if current is None else (current.tags.get("previous_champion") or None),
        None if to_version is None else str(get_version(client, to_version, name).version),
        existing, incident,
    )
    if action != "move":
        return RollbackPlan(incident, frm, to, action, existing)
    # The intent first (or the one recorded by an attempt that was killed): whatever happens
    # from here, a retry finds it and finishes this move instead of planning another.
    record = existing or {"incident": incident, "from": frm, "to": to, "reason": reason,
                          "requested_by": requested_by, "requested_at": now_iso(), "status": "moving"}
    if existing is None:
        record_incident(client, incident, record, name)
    now = by_alias(client, CHAMPION, name)
    if now is None or str(now.version) != to:
        if now is None or str(now.version) != frm:
            raise RegistryError(f"rollback for incident {incident}: champion moved to "
                                f"{'nothing' if now is None else 'v' + str(now.version)} while it was being rolled "
                                f"back from v{frm}; nothing was changed")
        client.set_registered_model_alias(name, CHAMPION, to)
    for key, value in {"rolled_back_from": frm, "rollback.incident": incident, "rollback.reason": record["reason"],
                       "rollback.requested_by": record["requested_by"], "rollback.at": record["requested_at"]}.items():
        client.set_model_version_tag(name, to, key, value)
    client.set_model_version_tag(name, frm, "rolled_back_by_incident", incident)
    record = {**record, "status": "moved"}
    record_incident(client, incident, record, name)
    return RollbackPlan(incident, frm, to, action, record)


def complete_rollback(client: MlflowClient, plan: RollbackPlan, served_version: str, name: str = POLICY) -> dict:
    record = {**plan.record, "status": "completed", "served_version": served_version, "completed_at": now_iso()}
    record_incident(client, plan.incident, record, name)
    return record


def fetch_version(tracking_uri: str, version: str, dest_root: Path, name: str = POLICY) -> Path:
    """Download `models:/<name>/<version>` to `<dest_root>/v<version>` (once; atomically)."""
    dest = dest_root / f"v{version}"
    if dest.is_dir():
        return dest
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=dest_root))
    try:
        # Ask the registry of *this* store where the version's files are: a `models:/` URI would
        # be resolved against the process-wide registry URI, which may be another store.
        source = MlflowClient(tracking_uri, registry_uri=tracking_uri).get_model_version_download_uri(name, version)
        local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri)
        os.replace(local, dest)  # the model directory itself, wherever the download nested it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest

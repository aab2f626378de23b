"""The real trigger: a run of the Prefect `rollback` deployment, started and not awaited."""
from __future__ import annotations

from monitoring.receiver.decision import INCIDENT_RE


class RollbackTriggerError(RuntimeError):
    """The rollback deployment could not be started."""


class PrefectRollbackTrigger:
    """Starts the `rollback` flow's deployment and returns the flow run id without waiting.

    The Prefect settings (API URL, profile) are those in effect where the trigger is made:
    the receiver calls it from HTTP handler threads, which do not inherit Prefect's
    context variables and would otherwise fall back to the environment's settings.
    """

    def __init__(self, deployment: str = "rollback/rollback", config_path: str | None = None,
                 parameters: dict | None = None):
        from prefect.context import get_settings_context

        self.deployment = deployment
        self.config_path = config_path
        self.parameters = dict(parameters or {})
        self._settings = get_settings_context()

    @property
    def api_url(self) -> str | None:
        return self._settings.settings.api.url

    def check(self) -> None:
        """Raise RollbackTriggerError unless a Prefect API is configured, answers, and has the
        deployment: a receiver that cannot start a rollback must not accept alerts."""
        from prefect import get_client
        from prefect.context import SettingsContext
        from prefect.exceptions import ObjectNotFound

        if self.api_url is None:
            raise RollbackTriggerError(
                "PREFECT_API_URL is not set: the receiver starts rollbacks on the Prefect server where the "
                f"{self.deployment!r} deployment lives; export PREFECT_API_URL=http://<host>:4200/api")
        with SettingsContext(profile=self._settings.profile, settings=self._settings.settings):
            try:
                with get_client(sync_client=True) as client:
                    client.read_deployment_by_name(self.deployment)
            except ObjectNotFound:
                raise RollbackTriggerError(
                    f"the Prefect API at {self.api_url} has no deployment {self.deployment!r}: deploy the rollback "
                    "flow there (prefect deploy --name rollback), or pass --deployment") from None
            except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same refusal
                raise RollbackTriggerError(
                    f"the Prefect API at {self.api_url} (PREFECT_API_URL) did not answer: {type(exc).__name__}: "
                    f"{exc}") from exc

    def parameters_for(self, incident: str, reason: str, requested_by: str) -> dict:
        return {**self.parameters, "incident": incident, "reason": reason, "requested_by": requested_by,
                **({"config_path": self.config_path} if self.config_path else {})}

    def __call__(self, incident: str, reason: str, requested_by: str) -> str:
        from prefect.context import SettingsContext
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        if not INCIDENT_RE.match(incident):
            raise RollbackTriggerError(f"incident id {incident!r} does not match {INCIDENT_RE.pattern}")
        # A fresh context object per call: one SettingsContext cannot be entered by two threads.
        with SettingsContext(profile=self._settings.profile, settings=self._settings.settings):
            try:
                flow_run = run_deployment(
                    name=self.deployment,
                    parameters=self.parameters_for(incident, reason, requested_by),
                    timeout=0,  # start it, do not wait for it
                    idempotency_key=f"alertmanager:{incident}",  # a retried call returns the same run
                    flow_run_name=f"rollback-{incident}",
                    as_subflow=False,
                )
            except ObjectNotFound as exc:
                raise RollbackTriggerError(
                    f"Prefect deployment {self.deployment!r} not found at {self.api_url or 'the ephemeral API'}"
                    " (deploy the rollback flow, or pass --deployment)") from exc
            except RollbackTriggerError:
                raise
            except Exception as exc:  # noqa: BLE001 - name Prefect, not just "Connection refused"
                raise RollbackTriggerError(
                    f"starting the Prefect deployment {self.deployment!r} at {self.api_url or 'the ephemeral API'} "
                    f"failed: {type(exc).__name__}: {exc}") from exc
        if not hasattr(flow_run, "id"):  # an async caller gets a coroutine from run_deployment
            raise RollbackTriggerError("PrefectRollbackTrigger must be called from synchronous code")
        return str(flow_run.id)

"""The MLflow model registry: register a stage's model directory as a new version."""
from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient


def register_model_version(
    client: MlflowClient, name: str, run_id: str, artifact_path: str, tags: dict[str, str], description: str = ""
) -> str:
    """Create (if needed) the registered model `name` and add `runs:/<run_id>/<artifact_path>`
    as a new version carrying `tags` (lineage). Returns the version number as a string."""
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "already exists" not in str(exc).lower() and exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=tags, description=description
    )
    return str(version.version)

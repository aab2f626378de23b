from mlflow.tracking import MlflowClient

from tasks.registry import register_model_version


def test_each_registration_is_a_new_version_with_its_lineage(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    versions = []
    for i in range(2):
        run = client.create_run(exp)
        client.log_artifacts(run.info.run_id, str(tmp_path / "model"), "model")
        versions.append(register_model_version(client, "reward-model", run.info.run_id, "model", {"dataset.fingerprint": f"sha256:{i}"}))
    assert versions == ["1", "2"]
    v2 = client.get_model_version("reward-model", "2")
    assert v2.tags["dataset.fingerprint"] == "sha256:1"
    assert v2.source.endswith("/model")

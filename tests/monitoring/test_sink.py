import math
import pickle

from mlflow.tracking import MlflowClient

from monitoring.sink import MlflowMetricsSink


def test_sink_pickles_and_logs_by_step_keeping_nan(tmp_path, mlflow_store):
    uri = mlflow_store
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("t", artifact_location=(tmp_path / "a").as_uri()))
    sink = MlflowMetricsSink(uri, run.info.run_id)
    sink(1, {"x/loss": 1.0})
    sink = pickle.loads(pickle.dumps(sink))  # as a Ray worker receives it
    sink(2, {"x/loss": 0.5, "x/bad": float("nan"), "x/note": "text is not a metric"})
    history = client.get_metric_history(run.info.run_id, "x/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5)]
    metrics = client.get_run(run.info.run_id).data.metrics
    assert set(metrics) == {"x/loss", "x/bad"} and math.isnan(metrics["x/bad"])

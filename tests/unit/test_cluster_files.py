"""The deployment files in cluster/: the launcher YAML against the schema that ships inside the
ray package, the KubeRay RayJob by structure, the runtime env by what a job needs."""

import json
from pathlib import Path

import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def test_launcher_yaml_matches_rays_schema():
    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((CLUSTER / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] == "head" and types["head"]["resources"]["CPU"] == 0
    assert "learner" in types["learner"]["resources"]
    assert types["rollout"]["resources"]["rollout"] > 0  # the elastic rollout node type
    assert types["rollout"]["min_workers"] == 0 < types["rollout"]["max_workers"]
    # every node gets this checkout and installs it (no placeholder package source)
    assert config["file_mounts"] == {"~/gdpo-ray": "."}
    assert any("~/gdpo-ray" in c or "$HOME/gdpo-ray" in c for c in config["setup_commands"])


def test_rayjob_has_the_same_layout():
    job = yaml.safe_load((CLUSTER / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    dockerfile = (CLUSTER / "Dockerfile").read_text()  # the image the manifest names is built here
    assert "COPY" in dockerfile and "/app[gpu]" in dockerfile
    assert spec["entrypoint"].startswith("python -m gdpo_ray train")
    runtime = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime["env_vars"]["RAY_AUTH_MODE"] == "disabled"
    cluster = spec["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"learner", "rollout"}
    for name, group in groups.items():
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert name in resources
        container = group["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(resources[name])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert groups["rollout"]["minReplicas"] == 0  # scaled by the autoscaler


def test_runtime_env_excludes_local_state_and_sets_job_env():
    env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert {".git", ".venv", "runs"} <= set(env["excludes"])
    assert env["env_vars"]["RAY_AUTH_MODE"] == "disabled"
    assert "NCCL_SOCKET_IFNAME" in env["env_vars"]
    assert all(isinstance(v, str) for v in env["env_vars"].values())

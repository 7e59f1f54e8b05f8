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


ROOT = CLUSTER.parent


def submit_commands() -> list[tuple[str, str]]:
    """(file, options) of every `ray job submit ... -- entrypoint` the docs show: the options
    before the entrypoint, line continuations and line breaks of inline code joined."""
    import re

    found = []
    for path in [ROOT / "README.md", CLUSTER / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"ray job submit([^`]*?) -- ", path.read_text(), re.S):
            if "\n\n" not in match.group(1):  # prose naming the command stops at its closing backtick
                found.append((path.relative_to(ROOT).as_posix(), match.group(1).replace("\\\n", " ")))
    return found


def runtime_env_of(options: str) -> tuple[str | None, dict]:
    """The working dir and runtime env one `ray job submit`'s options give (as Ray's CLI merges
    them: --runtime-env's YAML file, --runtime-env-json over it, --working-dir over both)."""
    import shlex

    args, env, working_dir = shlex.split(options), {}, None
    for flag, value in zip(args, args[1:]):
        if flag == "--runtime-env":
            env |= yaml.safe_load((ROOT / value).read_text())
        elif flag == "--runtime-env-json":
            env |= json.loads(value)
        elif flag == "--working-dir":
            working_dir = value
    return working_dir, env


def test_every_documented_job_submission_leaves_past_runs_at_home(tmp_path):
    """Each `ray job submit --working-dir .` the docs show, applied by Ray's own packaging to a
    user's folder that holds past runs and a virtual environment (and no .gitignore): the
    config, data and reward module go; nothing under runs/ or .venv/ does."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    folder = tmp_path / "my_project"
    for name in ("config.yaml", "train.jsonl", "my_rewards.py", "runs/demo-1/checkpoints/final/learner/model.pt",
                 "runs/demo-1/policy/model.safetensors", ".venv/lib/site.py"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    commands = [(where, runtime_env_of(options)) for where, options in submit_commands()]
    local = [(where, env) for where, (working_dir, env) in commands if working_dir == "."]
    assert len(local) >= 4, commands  # README, docs/cluster.md (2), cluster/README.md (2)
    for i, (where, env) in enumerate(local):
        package = tmp_path / f"package{i}.zip"
        create_package(str(folder), package, include_gitignore=True, excludes=env.get("excludes"))
        names = zipfile.ZipFile(package).namelist()
        assert {"config.yaml", "train.jsonl", "my_rewards.py"} <= set(names), (where, names)
        assert not [n for n in names if n.startswith(("runs/", ".venv/"))], (
            f"{where}: `ray job submit --working-dir .` uploads the folder's past runs: add "
            f"--runtime-env-json '{{\"excludes\": [\"runs/\", \".venv/\"]}}'", names)

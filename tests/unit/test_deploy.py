"""Static checks of deploy/: every file parses, every command is a real ``tether`` call whose config
validates, every referenced file exists, and the dashboard plots only metrics tether exports.

There is no Docker or Kubernetes here, so the checks read the files the way those tools would: compose
interpolation from deploy/.env.example, ``$(VAR)`` expansion of pod args, shell variables from the
scripts' own ``VAR=${VAR:-default}`` lines.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tether.commands.cli import COMMANDS, build_parser
from tether.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
SCRIPTS = [DEPLOY / "launch_rollout_fleet.sh", DEPLOY / "slurm" / "learner.sbatch", DEPLOY / "slurm" / "rollout.sbatch"]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
METRICS = {
    "tether_rollout_generated_tokens_total",
    "tether_rollout_policy_version",
    "tether_rollout_running_requests",
    "tether_buffer_depth",
    "tether_buffer_oldest_age_seconds",
    "tether_learner_staleness_mean",
    "tether_learner_step_seconds",
    "tether_weight_sync_seconds",
    "tether_buffer_prompt_backlog",  # the rollout HPA's signal (deploy/k8s/hpa.yaml)
}
_NUMERIC = re.compile(r"port|index|rank|nodeid|nnodes|num_nodes|nproc|gpus_per|servers|^i$")


def _placeholder(name: str) -> str:
    return "1" if _NUMERIC.search(name.lower()) else "x1"


def expand(text: str, env: dict[str, str]) -> str:
    """Resolve ``${V:-d}``, ``${V:?m}``, ``$V``, ``$(V)``/``$(cmd)`` (``$$`` as in compose) to values."""
    text = re.sub(r'"?\$\{\w+\[@\]\}"?', "", text)  # "${ARRAY[@]}": no extra overrides by default

    def braced(m: re.Match[str]) -> str:
        name, op, word = m.group(1), m.group(2), m.group(3) or ""
        if name in env:
            return env[name]
        return expand(word, env) if op in (":-", "-") else _placeholder(name)

    text = re.sub(r"\$\$?\{(\w+)(?:(:?[-?=+])([^}]*))?\}", braced, text)
    text = re.sub(r"\$\$?\(([A-Z_][A-Z0-9_]*)\)", lambda m: env.get(m.group(1), _placeholder(m.group(1))), text)
    text = re.sub(r"\$\$?\((?:[^()]|\([^()]*\))*\)", "x1", text)  # command substitution
    return re.sub(r"\$\$?(\w+)", lambda m: env.get(m.group(1), _placeholder(m.group(1))), text)


def tether_calls(argv: list[str], env: dict[str, str]) -> list[list[str]]:
    """``tether ...`` argument lists in an argv, looking inside ``sh -c``/``bash -c`` scripts too."""
    calls: list[list[str]] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "-c" and Path(argv[i - 2] if i >= 2 else "").name in ("sh", "bash"):
            calls += shell_calls(arg, env)
    # an unquoted variable that is empty (TETHER_LEARNER_ARGS by default) is no word at all in sh
    words = [expand(a, env) for a in argv if not (re.fullmatch(r"\$\$?\w+", a) and expand(a, env) == "")]
    for i, word in enumerate(words):
        if Path(word).name == "tether" and (i == 0 or "=" in words[i - 1] or words[i - 1] in ("exec", "nohup")):
            calls.append(words[i:])
    return calls


def shell_calls(script: str, env: dict[str, str]) -> list[list[str]]:
    env = dict(env)
    calls: list[list[str]] = []
    for line in script.replace("\\\n", " ").replace("\\$", "$").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assign = re.fullmatch(r"(\w+)=\$\{\1:-(.*)\}", line)
        if assign:
            env.setdefault(assign.group(1), expand(assign.group(2), env))
            continue
        line = re.sub(r'"\$TETHER"', "tether", line)
        line = re.sub(r'"?\$\{\w+\[@\]\}"?', "", line)  # "${ARRAY[@]}": no extra overrides by default
        words = shlex.split(line, comments=True)
        for part in _split_commands(words):
            calls += tether_calls(part, env)
    return calls


def _split_commands(words: list[str]) -> list[list[str]]:
    parts, cur = [], []
    for w in words:
        if w in ("&&", "||", ";", "|", "&") or (w.endswith((";", "&")) and len(w) > 1 and w not in ("-c",)):
            stripped = w.rstrip(";&")
            if stripped and stripped not in ("&&", "||", "|"):
                cur.append(stripped)
            parts.append(cur)
            cur = []
        elif w.startswith(">") or w.startswith("2>"):
            continue
        else:
            cur.append(w)
    parts.append(cur)
    return [p for p in parts if p]


def validate_call(argv: list[str], config_files: dict[str, Path]) -> None:
    """The argv (``tether SUB ...``) names a real subcommand, and its config + overrides validate."""
    assert Path(argv[0]).name == "tether", argv
    args, overrides = build_parser().parse_known_args(argv[1:])
    assert args.command in COMMANDS, argv
    if args.command == "make-tiny-model":
        assert not overrides, argv
        return
    assert args.config, f"no --config in {argv}"
    path = config_files.get(args.config) or ROOT / args.config
    assert path.is_file(), f"{argv}: config {args.config} does not exist ({path})"
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        pytest.fail(f"{' '.join(argv)}: {e}")
    if args.command in ("learner", "rollout", "status"):
        assert cfg.run.run_id, f"{argv}: processes launched separately need run.run_id"


# ---- docker compose -------------------------------------------------------------------------------


def _env_example() -> dict[str, str]:
    env = {}
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "learner", "rollout", "reward", "prometheus", "grafana"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    assert "healthcheck" in services["redis"]
    for name in ("rollout", "rollout-cpu", "reward"):
        test = " ".join(services[name]["healthcheck"]["test"])
        assert "tether.healthcheck" in test, name
    assert "ports" not in services["rollout"], "replicas must not bind fixed host ports (--scale)"
    assert set(services["prometheus"]["profiles"]) == {"monitoring"}
    assert {"learner-cpu", "rollout-cpu"} <= {n for n, s in services.items() if "cpu" in s.get("profiles", [])}
    assert "nvidia" in json.dumps(services["rollout"]["deploy"])


def test_compose_variables_are_in_env_example() -> None:
    text = (DEPLOY / "docker-compose.yml").read_text()
    used = set(re.findall(r"(?<!\$)\$\{(\w+)", text))
    assert used <= set(_env_example()), f"not in deploy/.env.example: {used - set(_env_example())}"
    assert {"TETHER_AUTH_TOKEN", "REDIS_PASSWORD", "COMPOSE_PROFILES"} <= set(_env_example())


def test_compose_commands_are_valid_tether_calls(compose: dict[str, Any]) -> None:
    env = _env_example()
    configs = {f"/etc/tether/{p.name}": p for p in (DEPLOY / "configs").glob("*.yaml")}
    seen = set()
    for name, service in compose["services"].items():
        if "tether" not in service.get("image", ""):
            continue
        argv = [*service.get("entrypoint", []), *service.get("command", [])]  # the images set no ENTRYPOINT
        assert Path(argv[0]).name in ("tether", "sh", "python", "gpu-lease.sh"), f"{name}: runs {argv[0]}"
        calls = tether_calls(argv, env)
        if name != "reward":
            assert calls, f"service {name}: no tether command in {argv}"
        for call in calls:
            validate_call(call, configs)
            seen.add((name, call[1]))
    assert {("learner", "learner"), ("rollout", "rollout"), ("learner-cpu", "make-tiny-model")} <= seen


def test_compose_referenced_files_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
        entry = service.get("entrypoint") or []
        for word in entry:
            if word.startswith("/app/"):
                assert (ROOT / word.removeprefix("/app/")).is_file(), f"{name}: {word}"
            elif word.endswith(".py"):
                assert (ROOT / word).is_file(), f"{name}: {word}"


def test_gpu_lease_script_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(DEPLOY / "gpu-lease.sh")]).returncode == 0


# ---- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_copies_exist_and_layers_are_cached(dockerfile: str) -> None:
    lines = (DEPLOY / dockerfile).read_text().splitlines()
    copies = [ln.split()[1:-1] for ln in lines if ln.startswith("COPY") and "--from" not in ln]
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile}: COPY {src} does not exist"
    first_source = next(i for i, ln in enumerate(lines) if ln.startswith("COPY tether"))
    deps = next(i for i, ln in enumerate(lines) if ln.startswith("COPY pyproject.toml"))
    assert deps < first_source, "dependencies must be installed before the source is copied"
    assert any(ln.startswith("USER ") and "root" not in ln for ln in lines), "runs as a non-root user"
    patterns = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert patterns[0] == "*", ".dockerignore is an allowlist: everything out, then what the images COPY"
    for src in {s for sources in copies for s in sources}:
        assert f"!{src}" in patterns or f"!{src.rstrip('/')}/" in patterns, f"{dockerfile}: COPY {src} not let in"


def _stages(dockerfile: str) -> list[str]:
    """The Dockerfile's stages, each the text from its ``FROM`` to the next (continuation lines joined)."""
    text = (DEPLOY / dockerfile).read_text().replace("\\\n", " ")
    return re.split(r"^FROM\s", text, flags=re.MULTILINE)[1:]


def _apt_packages(stage: str) -> set[str]:
    words = {w for m in re.finditer(r"apt-get install ([^&\n]*)", stage) for w in m.group(1).split()}
    return {w for w in words if not w.startswith("-")}


def test_gpu_runtime_image_can_compile_triton_kernels() -> None:
    """Triton (vLLM's kernels, torch.compile) compiles a C launcher per kernel when it first runs one: the
    image that runs tether — the last stage, not the build stage — needs a C compiler and Python.h, else
    the first kernel fails with "Failed to find C compiler"."""
    runtime = _stages("Dockerfile.gpu")[-1]
    assert "runtime" in runtime.split()[0], "the last stage is the CUDA runtime image tether runs in"
    packages = _apt_packages(runtime)
    assert packages & {"gcc", "clang", "build-essential"}, f"no C compiler in the runtime stage: {sorted(packages)}"
    assert any(re.fullmatch(r"(lib)?python3(\.\d+)?-dev", p) for p in packages), (
        f"no Python headers (python3-dev) in the runtime stage: {sorted(packages)}"
    )
    assert packages & {"libc6-dev", "build-essential"}, "the compiler needs the C library's headers"


def test_cpu_image_pins_cpu_torch() -> None:
    text = (DEPLOY / "Dockerfile.cpu").read_text()
    assert "python:3.11-slim" in text
    assert re.search(r'ARG TORCH_PIP_ARGS="--index-url https://download\.pytorch\.org/whl/cpu"', text)
    assert re.search(r'pip install \$\{TORCH_PIP_ARGS\} "torch==2\.13\.0"', text)


# ---- Kubernetes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in K8S:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests_parse(k8s_docs: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in k8s_docs}
    assert {"Job", "Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "NetworkPolicy"} <= kinds
    assert "HorizontalPodAutoscaler" in kinds
    for doc in k8s_docs:
        assert (doc.get("apiVersion") and doc.get("metadata", {}).get("name")) or doc["kind"] == "Kustomization"
    listed = next(d for d in k8s_docs if d["kind"] == "Kustomization")["resources"]
    for resource in listed:
        assert (DEPLOY / "k8s" / resource).is_file(), resource


def _by(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_k8s_commands_validate(k8s_docs: list[dict[str, Any]], tmp_path: Path) -> None:
    configmap = _by(k8s_docs, "ConfigMap", "tether-config")
    configs = {}
    for key, text in configmap["data"].items():
        (tmp_path / key).write_text(text)
        configs[f"/etc/tether/{key}"] = tmp_path / key
    n_calls = 0
    for doc in k8s_docs:
        if doc["kind"] not in ("Job", "Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            for call in tether_calls([*container.get("command", []), *container.get("args", [])], env):
                validate_call(call, configs)
                n_calls += 1
    assert n_calls == 2  # the learner and the rollout fleet


def test_k8s_learner_job_and_rollout_probes(k8s_docs: list[dict[str, Any]]) -> None:
    job = _by(k8s_docs, "Job", "learner")
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    service = _by(k8s_docs, "Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    args = pod["containers"][0]["args"]
    assert args[args.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)"
    assert args[args.index("--nnodes") + 1] == str(job["spec"]["completions"])
    rollout = _by(k8s_docs, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert rollout[probe]["grpc"]["port"] == 50051
    hpa = _by(k8s_docs, "HorizontalPodAutoscaler", "rollout")
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] in METRICS
    redis = _by(k8s_docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    assert "--appendonly" in redis["args"]


def test_k8s_network_policy_opens_only_tether_ports(k8s_docs: list[dict[str, Any]]) -> None:
    allowed = {50051, 29500, 29600, 6379, 9100, 9400, 32768}
    policies = [d for d in k8s_docs if d["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies)
    ports = {p["port"] for pol in policies for rule in pol["spec"].get("ingress", []) for p in rule["ports"]}
    assert ports == allowed


# ---- scripts, monitoring, recipes -----------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_commands_validate(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    calls = shell_calls(script.read_text(), {})
    if script.name == "rollout.sbatch":  # it runs launch_rollout_fleet.sh, checked on its own
        assert "launch_rollout_fleet.sh" in script.read_text()
    else:
        assert calls, f"no tether command in {script.name}"
    for call in calls:
        validate_call(call, {})


def test_prometheus_scrapes_learner_and_rollout() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    rollout = jobs["tether-rollout"]["dns_sd_configs"][0]
    assert "rollout" in rollout["names"] and rollout["port"] == 9100
    assert "learner" in jobs["tether-learner"]["dns_sd_configs"][0]["names"]
    for path in (DEPLOY / "configs").glob("*.yaml"):
        assert load_config(path).rollout.metrics_port == rollout["port"], path.name


def test_grafana_dashboard_uses_known_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "tether.json").read_text())
    used = set()
    for panel in dash["panels"]:
        names = {n for t in panel["targets"] for n in re.findall(r"\btether_[a-z_]+", t["expr"])}
        assert names, panel["title"]
        assert names <= METRICS, f"{panel['title']}: unknown {names - METRICS}"
        used |= names
    assert used == METRICS
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("tokens/s", "depth", "age", "staleness", "policy version", "step time", "weight sync"):
        assert word in titles


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_validate_with_the_cli(recipe: Path) -> None:
    from tether.commands.cli import main

    assert main(["config", "--config", str(recipe)]) == 0


def test_recipe_pair_differs_only_in_staleness() -> None:
    cfg = {p.name: load_config(p) for p in RECIPES}
    asyn, sync = cfg["qwen2.5-0.5b-gsm8k-vllm.yaml"], cfg["qwen2.5-0.5b-gsm8k-sync.yaml"]
    assert asyn.rollout.engine.type == "vllm" and asyn.rollout.reward.type == "math"
    assert asyn.weight_sync.transport.type == "nccl"
    assert (asyn.algorithm.max_staleness, sync.algorithm.max_staleness) == (1, 0)
    a, s = asyn.model_dump(), sync.model_dump()
    a["algorithm"].pop("max_staleness"), s["algorithm"].pop("max_staleness")
    a["run"].pop("run_id"), s["run"].pop("run_id")
    assert a == s


def test_every_subcommand_registers_one_way_and_runs_one_function() -> None:
    """``tether --help`` lists exactly the commands ``main`` can run, each registered by an ``add_parser(sub)``."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)

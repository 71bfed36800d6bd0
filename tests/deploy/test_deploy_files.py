"""The deploy files (deploy/): parsed, never run, and checked for the properties the
deployments' security rests on: the engine is never published, only the gateway may reach it,
everything runs as non-root with probes, the policy is read-only and secrets are not literals,
every command line uses flags the real CLI has, every image installs the versions of
requirements.lock, the gateway's image (and every service that runs it) carries no torch, the
CPU engine can compile its decode kernel into a writable cache, and the Compose keyring step
runs on a fresh checkout.

Images are not built here (no container engine on the test machines); the Dockerfiles are
split into stages and checked line by line instead, and the command that derives an image's
constraints from the lock is run on the real lock.
"""
from __future__ import annotations

import ast
import io
import ipaddress
import json
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PACKAGE = ROOT / "portcullis"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.fleet.yml")
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
IMAGE_UID = 10001
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL|PRIVATE", re.IGNORECASE)
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


# ---- parsers -------------------------------------------------------------------------

# libyaml when present: pure-Python parsing of every manifest per test would dominate the run.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=LOADER)


@cache
def compose(name: str = "docker-compose.yml") -> dict[str, Any]:
    """Parsed once per run; tests only read it."""
    return load_yaml(DEPLOY / name)


@cache
def k8s_documents() -> tuple[dict[str, Any], ...]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.load_all(path.read_text(), Loader=LOADER) if d]
    return tuple(docs)


def k8s(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in k8s_documents()
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def k8s_one(kind: str, name: str) -> dict[str, Any]:
    found = k8s(kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}}: comments dropped, backslash
    continuations joined, repeated keys kept (systemd accumulates or resets them)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} before any [section]"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    return parse_unit(SYSTEMD / name)


def last(section: dict[str, list[str]], key: str) -> str | None:
    values = section.get(key)
    return values[-1] if values else None


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuations joined, comment lines dropped (Docker
    drops them even inside a continued instruction)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def dockerfile_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for instruction, rest in instructions:
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            args.setdefault(name, default)
    return args


def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def with_defaults(text: str) -> str:
    """Compose-style `${VAR:-default}` replaced by its default, as with an empty environment."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", text)


# ---- Compose -------------------------------------------------------------------------

def service_networks(service: dict[str, Any]) -> list[str]:
    networks = service.get("networks", [])
    return list(networks) if isinstance(networks, (list, dict)) else []


def mounts(service: dict[str, Any]) -> list[tuple[str, bool]]:
    """(target, read_only) for each volume of a Compose service, short or long syntax."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            parts = volume.split(":")
            target = parts[1] if len(parts) > 1 else parts[0]
            out.append((target, len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            out.append((volume["target"], bool(volume.get("read_only"))))
    return out


def test_compose_publishes_only_the_gateway():
    services = compose()["services"]
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"gateway"}
    for name in COMPOSE_FILES:
        for service_name, service in compose(name)["services"].items():
            if service_name != "gateway":
                assert "ports" not in service, f"{name}: {service_name} publishes ports"
                assert "expose" not in service, f"{name}: {service_name} exposes ports"
    assert "network_mode" not in services["engine"], "host networking would bypass the internal network"


def test_compose_engine_only_on_internal_networks():
    doc = compose()
    nets = doc["networks"]
    engine_nets = service_networks(doc["services"]["engine"])
    assert engine_nets, "the engine must name its networks (the default network is not internal)"
    for net in engine_nets:
        assert nets[net].get("internal") is True, f"engine network {net!r} is not internal: true"
    redis_nets = service_networks(doc["services"]["redis"])
    assert all(nets[n].get("internal") is True for n in redis_nets)
    assert not set(redis_nets) & set(engine_nets), "the engine must not reach the rate-limit store"


def test_compose_gateway_bridges_internal_and_public():
    doc = compose()
    nets = doc["networks"]
    gateway_nets = service_networks(doc["services"]["gateway"])
    engine_nets = set(service_networks(doc["services"]["engine"]))
    assert engine_nets <= set(gateway_nets), "the gateway must share the engine's network"
    assert any(not nets[n].get("internal") for n in gateway_nets), "the gateway needs a public network"


def test_compose_gateway_reaches_the_engine_by_service_name_and_port():
    services = compose()["services"]
    engine_cmd = [with_defaults(str(a)) for a in services["engine"]["command"]]
    gateway_cmd = [with_defaults(str(a)) for a in services["gateway"]["command"]]
    url = urlsplit(flag_value(gateway_cmd, "--engine-url"))
    assert url.hostname == "engine"
    assert str(url.port) == flag_value(engine_cmd, "--port")


def test_compose_services_run_as_non_root_with_healthchecks_and_restart():
    services = compose()["services"]
    for name, service in services.items():
        user = str(service.get("user", ""))
        assert user and user.split(":")[0] not in ("0", "root"), f"{name} runs as root"
        assert service.get("read_only") is True, f"{name}: root filesystem not read-only"
        assert "ALL" in service.get("cap_drop", []), f"{name} keeps capabilities"
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert "privileged" not in service, name
    for name in ("engine", "gateway"):
        assert services[name]["user"] == f"{IMAGE_UID}:{IMAGE_UID}"
    for name in ("engine", "gateway", "redis"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
        assert services[name]["restart"] in ("always", "unless-stopped"), name


def test_compose_policy_mounted_read_only_and_engine_models_read_only():
    services = compose()["services"]
    for name, service in services.items():
        if "admin" in service.get("profiles", []):
            continue  # the one-off CLI rewrites keys.yaml; it has no network at all
        for target, read_only in mounts(service):
            if target.startswith("/etc/portcullis"):
                assert read_only, f"{name} mounts {target} writable"
    assert services["cli"]["network_mode"] == "none"
    assert ("/etc/portcullis", True) in mounts(services["gateway"])
    assert ("/models", True) in mounts(services["engine"])


def test_compose_policy_directory_holds_a_valid_deployment_policy():
    from portcullis.gateway.policy.loader import load_policy

    source = next(v for v in compose()["services"]["gateway"]["volumes"] if v.endswith(":/etc/portcullis:ro"))
    folder = (DEPLOY / source.split(":")[0]).resolve()
    command = [str(a) for a in compose()["services"]["gateway"]["command"]]
    policy_in_container = Path(flag_value(command, "--policy"))
    loaded = load_policy(folder / policy_in_container.relative_to("/etc/portcullis"))
    audit = Path(loaded.policy.audit.path)
    assert audit.is_absolute(), "the policy directory is read-only: audit.path must point elsewhere"
    assert any(t != "/etc/portcullis" and audit.is_relative_to(t)
               for t, ro in mounts(compose()["services"]["gateway"]) if not ro), "audit.path is not on a writable volume"


def test_compose_has_no_literal_secrets():
    for name in COMPOSE_FILES:
        doc = compose(name)
        for service_name, service in doc["services"].items():
            env = service.get("environment") or {}
            items = env.items() if isinstance(env, dict) else (e.partition("=")[::2] for e in env)
            for key, value in items:
                if SECRET_NAME.search(key):
                    reference = INTERPOLATION.fullmatch(str(value or ""))
                    assert not value or (reference and not reference.group(2)), (
                        f"{name}: {service_name} sets {key} to a literal; pass it through or use secrets:")
            command = " ".join(str(c) for c in service.get("command", []) or [])
            assert "--api-key" not in command, f"{service_name}: a token on the command line shows in ps"
    doc = compose()
    assert set(doc["secrets"]["engine_token"]) == {"file"}
    for service_name in ("engine", "gateway"):
        service = doc["services"][service_name]
        assert "engine_token" in service["secrets"]
        command = [str(a) for a in service["command"]]
        flag = "--token-file" if service_name == "engine" else "--engine-token-file"
        assert flag_value(command, flag) == "/run/secrets/engine_token"


def test_compose_gpu_override_reserves_an_nvidia_device_for_the_engine():
    engine = compose("docker-compose.gpu.yml")["services"]["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert engine["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    assert set(compose("docker-compose.gpu.yml")["services"]) == {"engine"}


# ---- Dockerfiles ---------------------------------------------------------------------
# Each Dockerfile is split into its stages; a target is checked as Docker builds it: its own
# instructions after its FROM chain's, and the build stages it copies from (COPY --from).

LOCK = ROOT / "requirements.lock"
# The images a Dockerfile is built for (compose's build.target, the README's --target).
TARGETS = {"Dockerfile": ("gateway", "engine"), "Dockerfile.cuda": ("engine",)}
DOCKER_TARGETS = [(name, target) for name, targets in TARGETS.items() for target in targets]
# Only the engine extra brings these; the gateway's image must hold none of them.
ENGINE_ONLY = {"torch", "transformers", "triton", "xgrammar", "tokenizers", "safetensors"}


def stages(name: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """{stage name: (what it is FROM, its instructions)}, in file order; ARGs before the first
    FROM are substituted into FROM lines."""
    instructions = parse_dockerfile(DEPLOY / name)
    args = dockerfile_args(instructions)
    found: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current: list[tuple[str, str]] | None = None
    for instruction, rest in instructions:
        if instruction == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            stage = words[2] if len(words) > 2 and words[1].upper() == "AS" else f"#{len(found)}"
            current = []
            found[stage] = (base, current)
        elif current is not None:
            current.append((instruction, rest))
    return found


def image_of(name: str, target: str) -> list[tuple[str, str]]:
    """The instructions that make up `target`'s image: its FROM chain, base first."""
    all_stages = stages(name)
    assert target in all_stages, f"{name} has no stage {target!r}"
    base, own = all_stages[target]
    return (image_of(name, base) if base in all_stages else []) + own


def copied_from(instructions: list[tuple[str, str]]) -> list[str]:
    return [m.group(1) for i, rest in instructions if i == "COPY"
            for m in [re.search(r"--from=(\S+)", rest)] if m]


def build_closure(name: str, target: str) -> list[tuple[str, str]]:
    """Every instruction that decides what `target` holds: its own chain and, recursively,
    the chains of the stages it copies from."""
    own = image_of(name, target)
    out = list(own)
    for stage in copied_from(own):
        if stage in stages(name):
            out += build_closure(name, stage)
    return out


def runs(instructions: list[tuple[str, str]]) -> list[str]:
    return [rest for instruction, rest in instructions if instruction == "RUN"]


def shell_parts(run: str) -> list[str]:
    """A RUN line's simple commands as written (shell expansions and quotes kept)."""
    # Separators, and the words that open a command ({ then do), never the braces of ${VAR}.
    parts = re.split(r"&&|\|\||;|(?<!\S)(?:then|do|\{|\})(?!\S)", run)
    return [part.strip() for part in parts if part.strip()]


def shell_commands(run: str) -> list[list[str]]:
    """A RUN line's simple commands, each as words."""
    commands = []
    for part in shell_parts(run):
        try:
            commands.append(shlex.split(part))
        except ValueError:
            continue
    return [words for words in commands if words]


def pip_installs(instructions: list[tuple[str, str]]) -> list[dict[str, list[str]]]:
    """Every `pip install` of these instructions: its packages and its -c / -r files."""
    found = []
    for run in runs(instructions):
        for words in shell_commands(run):
            if words[:2] != ["pip", "install"] and words[1:4] != ["-m", "pip", "install"]:
                continue
            words = words[words.index("install") + 1:]
            spec: dict[str, list[str]] = {"packages": [], "constraints": [], "requirements": []}
            i = 0
            while i < len(words):
                word = words[i]
                key = {"-c": "constraints", "--constraint": "constraints",
                       "-r": "requirements", "--requirement": "requirements"}.get(word.split("=")[0])
                if key:
                    spec[key].append(word.split("=", 1)[1] if "=" in word else words[i + 1])
                    i += 1 if "=" in word else 2
                    continue
                if word.startswith("--index-url") or word.startswith("--extra-index-url"):
                    i += 1 if "=" in word else 2
                    continue
                if not word.startswith(("-", "$")):
                    spec["packages"].append(word)
                i += 1
            found.append(spec)
    return found


def requirement_name(spec: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", spec.strip()).group(0)).lower()


def extras_of(package: str) -> set[str]:
    match = re.fullmatch(r"\.\[([\w,\s-]*)\]", package)
    return {e.strip() for e in match.group(1).split(",")} if match else set()


def lock_pins(text: str) -> dict[str, str]:
    """{package: the line that pins it} for a requirements / constraints text."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            assert "==" in line, f"not a pin: {line!r}"
            pins[requirement_name(line)] = line
    return pins


def lock_dependents() -> dict[str, set[str]]:
    """{package: the locked packages it pulls in}, from pip-compile's `# via` notes."""
    pulls: dict[str, set[str]] = {}
    package = None
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            package = requirement_name(line)
        elif package and line.startswith(" "):  # `    # via x` or `    #   x`, under its package
            for via in re.findall(r"#\s+(?:via\s+)?([A-Za-z0-9._-]+)", line):
                if via not in ("via", "-r"):
                    pulls.setdefault(requirement_name(via), set()).add(package)
    return pulls


def pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def installed_by(extras: set[str]) -> set[str]:
    """What `pip install -c requirements.lock '.[extras]'` brings in, by the lock's graph."""
    project = pyproject()["project"]
    optional = project["optional-dependencies"]
    wanted, todo = set(), set(extras)
    while todo:  # extras naming extras: all = portcullis-llm[engine,bench,otel]
        extra = todo.pop()
        for spec in optional[extra]:
            if requirement_name(spec) == requirement_name(project["name"]):
                todo |= set(re.search(r"\[(.*)\]", spec).group(1).split(",")) - wanted
            else:
                wanted.add(requirement_name(spec))
    needed = {requirement_name(s) for s in project["dependencies"]} | wanted
    pulls, frontier = lock_dependents(), set(needed)
    while frontier:
        frontier = {d for p in frontier for d in pulls.get(p, ())} - needed
        needed |= frontier
    return needed


def derived_constraints(instructions: list[tuple[str, str]], path: str, env: dict[str, str],
                        tmp_path: Path) -> str:
    """Run the command that writes the constraints file `path` from requirements.lock (as the
    image build would, in a scratch folder) and return what it wrote."""
    makers = [part for run in runs(instructions) for part in shell_parts(run)
              if "requirements.lock" in part and re.search(rf">\s*{re.escape(path)}$", part)]
    assert len(makers) == 1, f"{path}: one command must write it from requirements.lock, found {makers}"
    folder = tmp_path / "ctx"
    folder.mkdir(exist_ok=True)
    (folder / "requirements.lock").write_text(LOCK.read_text())
    out = folder / "constraints.out"
    command = re.sub(rf">\s*{re.escape(path)}$", f"> {shlex.quote(str(out))}", makers[0])
    subprocess.run(["sh", "-c", command], cwd=folder, env={"PATH": "/usr/bin:/bin", **env}, check=True)
    return out.read_text()


def test_the_lock_pins_every_package_for_the_images():
    pins = lock_pins(LOCK.read_text())
    assert pins["torch"].startswith("torch=="), "the lock must pin torch"
    for name in ("transformers", "fastapi", "triton", "xgrammar", "opentelemetry-sdk"):
        assert name in pins, f"requirements.lock does not pin {name}"
    assert not installed_by({"otel"}) & ENGINE_ONLY, "the base install + otel must not pull the engine's stack"
    assert ENGINE_ONLY <= installed_by({"engine"})


@pytest.mark.parametrize("name,target", DOCKER_TARGETS)
def test_dockerfile_installs_from_the_lock(name, target, tmp_path):
    closure = build_closure(name, target)
    args = dockerfile_args(parse_dockerfile(DEPLOY / name))
    copied = {w for i, rest in closure if i == "COPY" and "--from" not in rest for w in rest.split()[:-1]}
    assert "requirements.lock" in copied, f"{name}:{target} does not COPY requirements.lock"
    installs = pip_installs(closure)
    project = [p for p in installs if any(pkg == "." or pkg.startswith(".[") for pkg in p["packages"])]
    assert len(project) == 1, f"{name}:{target}: one install of the project, found {project}"
    assert not project[0]["requirements"], "-r would install every locked package, engine's too"
    [constraints] = project[0]["constraints"] or [None]
    assert constraints, f"{name}:{target} installs the project without the lock (-c requirements.lock)"
    lock = lock_pins(LOCK.read_text())
    if constraints == "requirements.lock":
        used = lock
    else:
        used = lock_pins(derived_constraints(closure, constraints, args, tmp_path))
    torch_version = args["TORCH_VERSION"]
    for package, line in lock.items():
        if package == "torch":
            # The plain version: it admits the CPU or CUDA build installed from the index.
            assert used.get("torch") in (None, line, f"torch=={torch_version}"), used.get("torch")
        elif package == "triton" and name == "Dockerfile.cuda":
            assert package not in used, "torch's CUDA build pins its own triton"
        else:
            assert used.get(package) == line, f"{name}:{target}: {package} is not held at the lock's {line}"
    for install in installs:
        if install is project[0]:
            continue
        assert install["packages"] == ['torch==${TORCH_VERSION}'], (
            f"{name}:{target}: `pip install {install}` bypasses the lock")


def test_dockerfile_torch_is_the_locked_release():
    locked = lock_pins(LOCK.read_text())["torch"].split("==")[1]
    for name in DOCKERFILES:
        assert dockerfile_args(parse_dockerfile(DEPLOY / name))["TORCH_VERSION"] == locked.split("+")[0]


def test_gateway_image_has_no_torch_and_proves_it():
    closure = build_closure("Dockerfile", "gateway")
    [install] = [p for p in pip_installs(closure) if any(pkg.startswith(".") for pkg in p["packages"])]
    extras = {e for pkg in install["packages"] for e in extras_of(pkg)}
    assert not extras & {"engine", "all", "bench"}, f"the gateway image installs {extras}"
    assert not installed_by(extras) & ENGINE_ONLY
    for spec in pip_installs(closure):
        assert not any(requirement_name(p) in ENGINE_ONLY for p in spec["packages"] if not p.startswith(".")), spec
    # The build itself fails if torch got in anyway: an import of it must fail.
    checks = [run for run in runs(closure) if re.search(r"\bimport\s+\$module\b|\bimport torch\b", run)]
    assert checks and all("exit 1" in run for run in checks), "the gateway build must prove torch is absent"
    assert any(re.search(r"for module in [^;]*\btorch\b", run) or "import torch" in run for run in checks)
    assert "engine-build" not in copied_from(image_of("Dockerfile", "gateway"))


@pytest.mark.parametrize("name,target", DOCKER_TARGETS)
def test_dockerfile_checks_the_version_it_is_tagged_with(name, target):
    closure = runs(build_closure(name, target))
    assert any('version("portcullis-llm")' in run and "$PORTCULLIS_VERSION" in run for run in closure)
    assert any(["pip", "check"] in shell_commands(run) for run in closure), "a broken environment must fail the build"
    if target == "engine":
        assert any("torch.__version__" in run and "$TORCH_VERSION" in run for run in closure)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_only_what_exists_and_the_context_lets_in(name):
    sources = set()
    for instruction, rest in parse_dockerfile(DEPLOY / name):
        if instruction in ("COPY", "ADD") and "--from" not in rest:
            words = [w for w in rest.split() if not w.startswith("--")]
            for source in words[:-1]:
                assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path in the repository"
                sources.add(source)
    project = pyproject()
    assert project["project"]["readme"] in sources, "setuptools needs the readme to build"
    packages = {p.split(".")[0] for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= sources, f"{name} does not COPY the package(s) {packages - sources}"
    assert {"pyproject.toml", "requirements.lock"} <= sources
    # BuildKit's <Dockerfile>.dockerignore: everything out, then exactly these back in.
    ignore = [line.strip() for line in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"
    assert {line[1:] for line in ignore if line.startswith("!")} == sources
    for pattern in (line for line in ignore[1:] if not line.startswith("!")):
        assert not any(Path(s).match(pattern.removeprefix("**/")) for s in sources), f"{pattern} drops a COPY source"


@pytest.mark.parametrize("name,target", DOCKER_TARGETS)
def test_dockerfile_runs_as_fixed_non_root_user(name, target):
    instructions = image_of(name, target)
    users = [rest for instruction, rest in instructions if instruction == "USER"]
    assert users, f"{name}:{target} has no USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root") and uid == str(IMAGE_UID), f"{name}:{target}: final USER {users[-1]}"
    after_user = instructions[max(i for i, (ins, _) in enumerate(instructions) if ins == "USER"):]
    assert not any(i == "RUN" for i, _ in after_user), "nothing may run as root after the USER switch"
    entrypoints = [rest for i, rest in instructions if i == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["portcullis"]
    # COPY --from leaves root as the owner: the user 10001 can run the venv, never change it.
    assert not any(i == "COPY" and "--chown" in rest for i, rest in instructions)


@pytest.mark.parametrize("name,target", DOCKER_TARGETS)
def test_dockerfile_healthcheck_volumes_and_only_the_gateway_port(name, target):
    instructions = image_of(name, target)
    health = [rest for instruction, rest in instructions if instruction == "HEALTHCHECK"]
    assert health and "NONE" not in health[-1].upper()
    exposed = [p for instruction, rest in instructions if instruction == "EXPOSE" for p in rest.split()]
    assert exposed == ["8000"], f"{name} exposes {exposed}: the engine's port must never be exposed"
    volumes = " ".join(rest for instruction, rest in instructions if instruction == "VOLUME")
    for path in ("/models", "/etc/portcullis", "/var/cache/portcullis", "/var/lib/portcullis"):
        assert f'"{path}"' in volumes, f"{name}: {path} is not a volume"
    assert (DEPLOY / "healthcheck.py").is_file()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_pins_versions(name):
    instructions = parse_dockerfile(DEPLOY / name)
    args = dockerfile_args(instructions)
    for base, _ in stages(name).values():
        if base in stages(name) or ":" not in base:
            continue  # a build stage by name
        tag = base.rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: {base} is not version-pinned"
    assert args["PORTCULLIS_VERSION"] == pyproject()["project"]["version"]
    torch_spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert args["TORCH_VERSION"] == torch_spec.group(1)
    assert args["TORCH_INDEX_URL"] == "", "no index host may be baked into the Dockerfile"
    assert any(i == "RUN" and '"torch==${TORCH_VERSION}"' in r for i, r in build_closure(name, "engine"))
    assert list(stages(name))[-1] == "engine", "a build without --target gives the engine, as before"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_bakes_no_secrets(name):
    for instruction, rest in parse_dockerfile(DEPLOY / name):
        if instruction in ("ENV", "ARG"):
            for name_value in re.findall(r"(\w+)=", rest):
                assert not SECRET_NAME.search(name_value), f"{name}: {instruction} {name_value}"
        if instruction in ("COPY", "ADD"):
            assert "secret" not in rest.lower() and "keys.yaml" not in rest, f"{name}: {instruction} {rest}"


# ---- which image each service runs -----------------------------------------------------

def built_images() -> dict[str, tuple[str, str]]:
    """{image: (Dockerfile, target)} for every image a Compose file builds."""
    built: dict[str, tuple[str, str]] = {}
    for name in COMPOSE_FILES:
        for service_name, service in compose(name)["services"].items():
            build = service.get("build")
            if not build:
                continue
            assert build["context"] == "..", f"{name}:{service_name}: the context is the repository root"
            dockerfile = Path(build["dockerfile"])
            assert (ROOT / dockerfile).is_file() and dockerfile.parent == Path("deploy"), dockerfile
            target = build.get("target")
            assert target in TARGETS[dockerfile.name], f"{name}:{service_name}: target {target!r}"
            image = service["image"]
            assert built.setdefault(image, (dockerfile.name, target)) == (dockerfile.name, target), (
                f"{image} is built from two different targets")
    return built


def service_role(name: str, service_name: str, service: dict[str, Any]) -> str | None:
    """engine or gateway: which half's image a Compose service needs."""
    command = [str(a) for a in service.get("command") or []]
    if command and command[0] in ("engine", "gateway"):
        return command[0]
    if "admin" in service.get("profiles", []):
        return "gateway"  # keys, policy and audit: the base install
    if service.get("entrypoint", [None])[0] == "hf":
        return "engine"  # huggingface-hub comes with the engine's packages
    return None


def test_compose_services_run_the_image_of_their_half():
    built = built_images()
    version = pyproject()["project"]["version"]
    roles: dict[str, set[str]] = {}
    for name in COMPOSE_FILES:
        for service_name, service in compose(name)["services"].items():
            role = service_role(name, service_name, service)
            if role is None:
                assert not service.get("image", "").startswith("portcullis"), f"{name}:{service_name}"
                continue
            image = service["image"]
            assert image in built, f"{name}:{service_name}: no Compose file builds {image}"
            assert built[image][1] == role, f"{name}:{service_name} ({role}) runs {image}, the {built[image][1]} target"
            assert image.split(":")[0] == f"portcullis-{role}" and image.split(":")[1].startswith(version)
            roles.setdefault(role, set()).add(service_name)
    assert {"engine", "engine-chat-1", "model-fetch"} <= roles["engine"]
    assert roles["gateway"] == {"gateway", "cli", "keyring"}
    gpu = compose("docker-compose.gpu.yml")["services"]["engine"]
    assert built[gpu["image"]] == ("Dockerfile.cuda", "engine")


def k8s_images(docs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(workload, container, image) for every container and init container."""
    out = []
    for doc in docs:
        if doc.get("kind") in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                out.append((doc["metadata"]["name"], c["name"], c["image"]))
    return out


def test_k8s_workloads_run_the_image_of_their_half():
    built = built_images()
    fleet = [d for p in sorted((DEPLOY / "k8s-fleet").glob("engine-*.yaml"))
             for d in yaml.load_all(p.read_text(), Loader=LOADER) if d]
    for docs, folder in ((list(k8s_documents()), K8S), (fleet, DEPLOY / "k8s-fleet")):
        named = {i["name"] for i in load_yaml(folder / "kustomization.yaml").get("images", [])}
        for workload, name, image in k8s_images(docs):
            role = "gateway" if workload == GATEWAY else "engine"
            assert image in built and built[image][1] == role, f"{workload}/{name} runs {image}, not the {role} image"
            assert image.split(":")[0] in named, f"{folder.name}/kustomization.yaml cannot repoint {image}"
    engines = [image for workload, _, image in k8s_images(list(k8s_documents()) + fleet) if workload != GATEWAY]
    assert engines and all(built[i] == ("Dockerfile.cuda", "engine") for i in engines), "the GPU engines"


def test_readme_systemd_recipe_installs_from_the_lock(tmp_path):
    text = (DEPLOY / "README.md").read_text()
    recipe = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.DOTALL) if "systemd-sysusers" in b)
    lines = [("RUN", line.removeprefix("sudo ")) for line in recipe.splitlines()]
    lines = [(i, re.sub(r"\S*/bin/pip install", "pip install", line)) for i, line in lines]
    installs = pip_installs(lines)
    [project] = [p for p in installs if any(pkg.startswith(".") for pkg in p["packages"])]
    assert "engine" in {e for pkg in project["packages"] for e in extras_of(pkg)}, "both units run from this venv"
    [constraints] = project["constraints"]
    used = lock_pins(derived_constraints(lines, constraints, {}, tmp_path))
    for package, line in lock_pins(LOCK.read_text()).items():
        if package != "torch":
            assert used[package] == line, package
    torch = next(p for p in installs if p is not project)
    assert torch["packages"] == [used["torch"]], "the constraints hold the torch installed first"


# ---- Kubernetes ----------------------------------------------------------------------

def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


ENGINE = "portcullis-engine"
GATEWAY = "portcullis-gateway"


def test_kustomization_lists_every_manifest():
    kustomization = load_yaml(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"missing from kustomization: {present - listed}; listed but absent: {listed - present}"
    assert not list(K8S.glob("*.yml")), "use .yaml so the kustomization check sees every file"


def test_deployment_selectors_and_services_match_pod_labels():
    for name in (ENGINE, GATEWAY):
        deployment = k8s_one("Deployment", name)
        labels = pod_labels(deployment)
        assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
        service = k8s_one("Service", name)
        assert selects(service["spec"]["selector"], labels)
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports or port["targetPort"] in ports.values()
    engine_labels, gateway_labels = pod_labels(k8s_one("Deployment", ENGINE)), pod_labels(k8s_one("Deployment", GATEWAY))
    assert not selects(k8s_one("Service", ENGINE)["spec"]["selector"], gateway_labels)
    assert not selects(k8s_one("Service", GATEWAY)["spec"]["selector"], engine_labels)


def test_engine_is_never_published():
    engine_labels = pod_labels(k8s_one("Deployment", ENGINE))
    for service in k8s("Service"):
        if selects(service["spec"].get("selector", {}), engine_labels):
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]
            assert not any("nodePort" in p for p in service["spec"]["ports"])
            assert "externalIPs" not in service["spec"]
    for ingress in k8s("Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] == GATEWAY, "only the gateway may be behind an Ingress"
    pod = k8s_one("Deployment", ENGINE)["spec"]["template"]["spec"]
    assert not pod.get("hostNetwork") and not any("hostPort" in p for p in container(k8s_one("Deployment", ENGINE))["ports"])


def test_networkpolicy_admits_only_gateway_pods_to_the_engine():
    engine, gateway = k8s_one("Deployment", ENGINE), k8s_one("Deployment", GATEWAY)
    policies = [p for p in k8s("NetworkPolicy") if selects(p["spec"]["podSelector"].get("matchLabels", {}), pod_labels(engine))]
    assert len(policies) == 1, "exactly one NetworkPolicy must select the engine pods"
    spec = policies[0]["spec"]
    assert not selects(spec["podSelector"]["matchLabels"], pod_labels(gateway))
    assert "Ingress" in spec["policyTypes"]
    engine_port = next(p["containerPort"] for p in container(engine)["ports"])
    for rule in spec["ingress"]:
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "no namespaceSelector/ipBlock: gateway pods only"
            assert selects(peer["podSelector"]["matchLabels"], pod_labels(gateway))
            assert not selects(peer["podSelector"]["matchLabels"], pod_labels(engine))
        assert [p["port"] for p in rule["ports"]] == [engine_port]
    assert "Egress" in spec["policyTypes"] and spec.get("egress") == [], "the engine needs no egress"


def test_pods_run_non_root_and_locked_down():
    for name in (ENGINE, GATEWAY):
        pod = k8s_one("Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        sc = container(k8s_one("Deployment", name))["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        assert not sc.get("privileged")
    namespace = k8s_one("Namespace", "portcullis")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def probe_path(c: dict[str, Any], kind: str) -> str:
    probe = c[kind]["httpGet"]
    assert probe["port"] in {p["name"] for p in c["ports"]}
    return probe["path"]


def test_probes_and_resources():
    engine, gateway = container(k8s_one("Deployment", ENGINE)), container(k8s_one("Deployment", GATEWAY))
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_path(engine, kind) == "/health"
    assert probe_path(gateway, "readinessProbe") == "/readyz"
    assert probe_path(gateway, "livenessProbe") == "/healthz"
    for c in (engine, gateway):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_engine_has_memory_backed_dev_shm():
    deployment = k8s_one("Deployment", ENGINE)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    shm = [m for m in container(deployment)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1
    empty_dir = volumes[shm[0]["name"]]["emptyDir"]
    assert empty_dir["medium"] == "Memory" and empty_dir["sizeLimit"]
    assert k8s_one("Deployment", ENGINE)["spec"]["strategy"]["type"] == "Recreate"


def volume_for(deployment: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (volumeMount, volume) whose mount holds `path`."""
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = max((m for m in container(deployment)["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])),
                key=lambda m: len(m["mountPath"]))
    return mount, volumes[mount["name"]]


def secret_of_file(volume: dict[str, Any], file: str) -> str | None:
    """The Secret a file in a secret or projected volume comes from (None: not from a Secret)."""
    if "secret" in volume:
        return volume["secret"]["secretName"]
    secrets = [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
    named = [s["name"] for s in secrets if any(i["path"] == file for i in s.get("items", []))]
    whole = [s["name"] for s in secrets if "items" not in s]
    return (named or whole or [None])[0]


def test_policy_read_only_and_token_files_come_from_secrets():
    engine, gateway = k8s_one("Deployment", ENGINE), k8s_one("Deployment", GATEWAY)
    gateway_args = container(gateway)["args"]
    mount, volume = volume_for(gateway, flag_value(gateway_args, "--policy"))
    assert mount["readOnly"] is True
    assert "portcullis-policy" in {s["configMap"]["name"] for s in volume["projected"]["sources"] if "configMap" in s}
    for deployment, flag in ((engine, "--token-file"), (gateway, "--engine-token-file")):
        path = flag_value(container(deployment)["args"], flag)
        mount, volume = volume_for(deployment, path)
        assert mount["readOnly"] is True
        assert secret_of_file(volume, str(Path(path).relative_to(mount["mountPath"]))) == "portcullis-engine-token"
    _, engine_volume = volume_for(engine, "/etc/portcullis/engine-token")
    assert set(engine_volume) == {"name", "secret"}, "the engine must see the token only, not API keys or JWKS"
    for deployment in (engine, gateway):
        assert "env" not in container(deployment) or all(
            not SECRET_NAME.search(e["name"]) or "valueFrom" in e for e in container(deployment)["env"])


def test_gateway_reaches_the_engine_service():
    url = urlsplit(flag_value(container(k8s_one("Deployment", GATEWAY))["args"], "--engine-url"))
    service = k8s_one("Service", ENGINE)
    assert url.hostname == service["metadata"]["name"]
    assert url.port in [p["port"] for p in service["spec"]["ports"]]


def test_configmap_policy_is_the_deployment_policy_and_valid(tmp_path):
    from portcullis.gateway.policy.loader import load_policy

    text = k8s_one("ConfigMap", "portcullis-policy")["data"]["policy.yaml"]
    assert text == (DEPLOY / "config" / "policy.yaml").read_text(), "k8s/policy-configmap.yaml drifted from config/policy.yaml"
    (tmp_path / "policy.yaml").write_text(text)
    loaded = load_policy(tmp_path / "policy.yaml")
    assert Path(loaded.policy.audit.path).is_absolute()
    audit_mount, _ = volume_for(k8s_one("Deployment", GATEWAY), loaded.policy.audit.path)
    assert not audit_mount.get("readOnly")


def test_secret_placeholders_are_marked_and_fail_closed():
    from portcullis.protocol.channel import MIN_ENGINE_TOKEN_CHARS as MIN_TOKEN_CHARS

    token = k8s_one("Secret", "portcullis-engine-token")["stringData"]["engine-token"]
    assert "REPLACE" in token and len(token) < MIN_TOKEN_CHARS, "a placeholder token must be refused by the gateway"
    keys = yaml.safe_load(k8s_one("Secret", "portcullis-gateway-keys")["stringData"]["keys.yaml"])
    assert keys["keys"] == [], "placeholder keys must admit nobody"
    assert "PLACEHOLDER" in (K8S / "secrets.yaml").read_text()


def test_gateway_has_a_disruption_budget_and_more_than_one_replica():
    gateway = k8s_one("Deployment", GATEWAY)
    budgets = [p for p in k8s("PodDisruptionBudget") if selects(p["spec"]["selector"]["matchLabels"], pod_labels(gateway))]
    assert len(budgets) == 1
    assert gateway["spec"]["replicas"] > budgets[0]["spec"]["minAvailable"]


# ---- systemd -------------------------------------------------------------------------

ENGINE_UNIT, GATEWAY_UNIT = "portcullis-engine.service", "portcullis-gateway.service"
HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
    "LockPersonality": "yes", "RestrictSUIDSGID": "yes", "RestrictNamespaces": "yes",
    "CapabilityBoundingSet": "",
}


@pytest.mark.parametrize("name", [ENGINE_UNIT, GATEWAY_UNIT])
def test_units_restart_as_a_dedicated_user_with_hardening(name):
    service = unit(name)["Service"]
    assert last(service, "Restart") == "always"
    user = last(service, "User")
    assert (user and user not in ("root", "0")) or last(service, "DynamicUser") == "yes"
    assert last(service, "Group") == user
    for key, value in HARDENING.items():
        assert last(service, key) == value, f"{name}: {key}={last(service, key)!r}, want {value!r}"
    assert last(service, "RestrictAddressFamilies"), f"{name}: RestrictAddressFamilies unset"
    assert "AF_PACKET" not in last(service, "RestrictAddressFamilies")
    assert unit(name)["Install"]["WantedBy"] == ["multi-user.target"]


def test_gpu_engine_keeps_devices_and_wx_the_gateway_drops_both():
    engine, gateway = unit(ENGINE_UNIT)["Service"], unit(GATEWAY_UNIT)["Service"]
    assert last(engine, "PrivateDevices") == "no" and last(engine, "MemoryDenyWriteExecute") == "no"
    assert last(gateway, "PrivateDevices") == "yes" and last(gateway, "MemoryDenyWriteExecute") == "yes"
    text = (SYSTEMD / ENGINE_UNIT).read_text()
    assert "# Not PrivateDevices=yes" in text and "# Not MemoryDenyWriteExecute=yes" in text, "say why"
    assert last(engine, "PrivateNetwork") == "yes", "the engine serves a Unix socket and needs no network"


def exec_start(name: str) -> list[str]:
    return shlex.split(last(unit(name)["Service"], "ExecStart"))


def test_units_share_a_private_socket_and_a_credential():
    engine, gateway = unit(ENGINE_UNIT), unit(GATEWAY_UNIT)
    assert last(engine["Service"], "User") == last(gateway["Service"], "User"), "the socket is 0600"
    runtime = last(engine["Service"], "RuntimeDirectory")
    assert runtime and last(engine["Service"], "RuntimeDirectoryMode") == "0700"
    socket = flag_value(exec_start(ENGINE_UNIT), "--uds")
    assert Path(socket).parent == Path("/run") / runtime
    assert flag_value(exec_start(GATEWAY_UNIT), "--engine-url") == f"unix://{socket}"
    for name, flag in ((ENGINE_UNIT, "--token-file"), (GATEWAY_UNIT, "--engine-token-file")):
        service = unit(name)["Service"]
        credential = last(service, "LoadCredential").split(":")[0]
        assert flag_value(exec_start(name), flag) == f"%d/{credential}"
        assert not any(SECRET_NAME.search(e) for e in service.get("Environment", []))
    for key in ("After", "Requires"):
        assert ENGINE_UNIT in " ".join(gateway["Unit"][key]).split(), f"gateway lacks {key}={ENGINE_UNIT}"
    assert last(gateway["Service"], "StateDirectory"), "the audit log needs a writable state directory"


def test_env_example_holds_no_secrets():
    for key, value in env_file(SYSTEMD / "portcullis.env.example").items():
        assert not SECRET_NAME.search(key), f"{key} belongs in a credential, not the environment file"
        assert "--api-key" not in value and "--token" not in value


# ---- command lines against the real CLI ----------------------------------------------

def flag_value(argv: list[str], flag: str) -> str:
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


def flags_in(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("-") and a != "-"}


def deploy_commands() -> dict[str, list[tuple[str, list[str]]]]:
    """Every engine and gateway command line in deploy/, as argv after the subcommand, with
    Compose/systemd variables replaced by the defaults and examples the files give."""
    found: dict[str, list[tuple[str, list[str]]]] = {"engine": [], "gateway": []}
    for name in COMPOSE_FILES:
        for service_name, service in compose(name)["services"].items():
            command = [with_defaults(str(a)) for a in service.get("command") or []]
            if command and command[0] in found:
                found[command[0]].append((f"{name}:{service_name}", command[1:]))
    for deployment in k8s("Deployment"):
        args = container(deployment)["args"]
        found[args[0]].append((f"k8s:{deployment['metadata']['name']}", args[1:]))
    for path in sorted((DEPLOY / "k8s-fleet").glob("engine-*.yaml")):  # the fleet's StatefulSets
        for doc in yaml.load_all(path.read_text(), Loader=LOADER):
            if doc and doc["kind"] == "StatefulSet":
                args = container(doc)["args"]
                found[args[0]].append((f"k8s-fleet:{doc['metadata']['name']}", args[1:]))
    env = env_file(SYSTEMD / "portcullis.env.example")
    for name in (ENGINE_UNIT, GATEWAY_UNIT):
        argv = []
        for word in exec_start(name)[1:]:
            word = word.replace("%d", "/run/credentials/x")
            if re.fullmatch(r"\$\w+", word):
                argv += env.get(word[1:], "").split()  # systemd splits an unbraced $VAR at spaces
            else:
                argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
        found[argv[0]].append((name, argv[1:]))
    return found


def test_every_deployment_runs_both_halves():
    commands = deploy_commands()
    assert {w.split(":")[0] for w, _ in commands["engine"]} >= {"docker-compose.yml", "docker-compose.gpu.yml", "k8s", ENGINE_UNIT}
    assert {w.split(":")[0] for w, _ in commands["gateway"]} >= {"docker-compose.yml", "k8s", GATEWAY_UNIT}


def help_flags(text: str) -> set[str]:
    """Option strings from argparse's help: the first column of each option line."""
    flags = set()
    for line in text.splitlines():
        # Option lines are indented by two spaces; wrapped help text by many more.
        match = re.match(r"^  (-.*?)(?:\s{2,}|$)", line)
        if match:
            flags |= set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", match.group(1)))
    return flags


def ast_flags(path: Path) -> set[str]:
    """Fallback while a CLI module exists but its entry point does not: literal add_argument names."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


HELP_COMMANDS = {
    "engine": (PACKAGE / "engine" / "__main__.py", PACKAGE / "engine" / "server" / "cli.py",
               ["-m", "portcullis.engine", "--help"]),
    "gateway": (PACKAGE / "cli" / "__main__.py", PACKAGE / "cli" / "gateway.py", ["-m", "portcullis.cli", "gateway", "--help"]),
}


@pytest.fixture(scope="module", autouse=True)
def help_processes():
    """`--help` of both entry points, started before the first test of this module so the
    engine's (which imports torch: seconds) runs while the file checks do."""
    started = {}
    for half, (entry, _, argv) in HELP_COMMANDS.items():
        if entry.is_file():
            started[half] = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
    yield started
    for process in started.values():
        process.kill()
        process.communicate()


def real_flags(half: str, processes: dict[str, subprocess.Popen]) -> set[str]:
    entry, module, _ = HELP_COMMANDS[half]
    if half in processes:
        out, err = processes[half].communicate(timeout=120)
        assert processes[half].returncode == 0, f"{half} --help failed: {err[-2000:]}"
        return help_flags(out)
    if module.is_file():
        return ast_flags(module)
    pytest.fail(f"the {half} CLI is missing: neither {entry} nor {module} exists")


@pytest.mark.parametrize("half", ["engine", "gateway"])
def test_deploy_command_lines_use_real_flags(half, help_processes):
    flags = real_flags(half, help_processes)
    assert "--help" in flags and len(flags) > 4, f"could not read {half}'s flags"
    for where, argv in deploy_commands()[half]:
        unknown = flags_in(argv) - flags
        assert not unknown, f"{where}: `portcullis {half}` has no {sorted(unknown)}"


def parse_cli(half: str, argv: list[str]) -> Any:
    """Parse with the real argparse parser (in-process: values are type-checked too)."""
    if half == "engine":
        from portcullis.engine.server.cli import build_parser
    else:
        from portcullis.cli import build_parser
    errors = io.StringIO()
    try:
        with redirect_stderr(errors), redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"`portcullis {half if half == 'engine' else ''} {' '.join(argv)}`: "
                             f"{errors.getvalue().strip()}") from None


def test_deploy_command_lines_parse_with_their_values():
    for half, lines in deploy_commands().items():
        for where, argv in lines:
            args = parse_cli(half, argv if half == "engine" else ["gateway", *argv])
            if half == "engine":
                assert args.uds or args.host, f"{where}: the engine must say where it listens"
                assert args.token_file and not args.api_key and not args.no_token, f"{where}: token from a file only"


# ---- the proxy in front: whose X-Forwarded-For the gateway believes --------------------
# Without it every client behind a proxy shares the proxy's address: in the audit log, and in
# the failed-authentication limit, where ~20 bad tokens from anyone lock everyone out.

NGINX_UPSTREAM_KEEPALIVE_S = 60  # nginx's and ingress-nginx's default for idle upstream connections


def trusted_proxies(argv: list[str]) -> list[Any]:
    """The gateway's --forwarded-allow-ips, as GatewaySettings accepts it at start-up."""
    from portcullis.gateway.settings import GatewaySettings

    value = flag_value(argv, "--forwarded-allow-ips")
    GatewaySettings(policy=DEPLOY / "config" / "policy.yaml", engine_token="x" * 32, forwarded_allow_ips=value)
    return [ipaddress.ip_network(entry.strip(), strict=False) for entry in value.split(",")]


def trusts(networks: list[Any], address: str) -> bool:
    return any(ipaddress.ip_address(address) in network for network in networks)


def test_every_gateway_believes_its_proxy_and_outlives_its_idle_connections():
    gateways = deploy_commands()["gateway"]
    assert {where.split(":")[0] for where, _ in gateways} >= {"docker-compose.yml", "k8s", GATEWAY_UNIT}
    for where, argv in gateways:
        assert trusted_proxies(argv), f"{where}: no --forwarded-allow-ips"
        # The proxy must close an idle connection before the gateway does, or it may send a
        # request on a connection the gateway is closing (a 502 for the client).
        assert float(flag_value(argv, "--timeout-keep-alive")) > NGINX_UPSTREAM_KEEPALIVE_S, where


def test_compose_gateway_believes_the_address_its_published_port_comes_from():
    spec = compose()
    gateway = spec["services"]["gateway"]
    assert gateway["ports"], "the gateway is reached through its published port"
    published = [n for n in gateway["networks"] if not spec["networks"][n].get("internal")]
    assert published == ["public"], "internal networks cannot publish ports"
    ipam = spec["networks"]["public"]["ipam"]["config"][0]
    subnet, address = ipaddress.ip_network(with_defaults(ipam["subnet"])), with_defaults(ipam["gateway"])
    assert ipaddress.ip_address(address) in subnet
    networks = trusted_proxies([with_defaults(str(a)) for a in gateway["command"]])
    assert trusts(networks, address)
    assert not any(trusts(networks, str(host)) for host in list(subnet.hosts())[1:5]), \
        "trust the port proxy's address, not the containers beside the gateway"


def test_k8s_gateway_believes_the_ingress_and_only_the_ingress_reaches_it():
    gateway = k8s_one("Deployment", GATEWAY)
    networks = trusted_proxies(container(gateway)["args"])
    for pod_address in ("10.244.1.7", "10.42.0.12", "172.20.3.4", "192.168.33.9"):  # common pod CIDRs
        assert trusts(networks, pod_address)
    assert not trusts(networks, "203.0.113.9"), "a public address is a client, never a proxy"
    backend = k8s_one("Ingress", GATEWAY)["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == GATEWAY
    policies = [p for p in k8s("NetworkPolicy") if selects(p["spec"]["podSelector"].get("matchLabels", {}), pod_labels(gateway))]
    assert len(policies) == 1, "exactly one NetworkPolicy must say who may reach the gateway pods"
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    port = container(gateway)["ports"][0]["containerPort"]
    for rule in spec["ingress"]:
        assert [p["port"] for p in rule["ports"]] == [port]
        for peer in rule["from"]:
            namespace = peer.get("namespaceSelector", {}).get("matchLabels", {})
            assert namespace == {"kubernetes.io/metadata.name": "ingress-nginx"}, f"{peer} is not the ingress"


def test_systemd_gateway_believes_the_local_nginx_that_overwrites_x_forwarded_for():
    argv = next(a for where, a in deploy_commands()["gateway"] if where == GATEWAY_UNIT)
    host, port = flag_value(argv, "--host"), flag_value(argv, "--port")
    assert ipaddress.ip_address(host).is_loopback, "only a proxy on this host can reach it"
    assert trusts(trusted_proxies(argv), host)
    nginx = re.search(r"```nginx\n(.*?)```", (DEPLOY / "README.md").read_text(), re.DOTALL).group(1)
    assert f"server {host}:{port};" in nginx
    # Overwritten, not appended to: a client's own X-Forwarded-For never reaches the gateway.
    assert re.search(r"proxy_set_header\s+X-Forwarded-For\s+\$remote_addr;", nginx)
    keepalive = re.search(r"keepalive_timeout\s+(\d+)s;", nginx)
    assert keepalive and int(keepalive.group(1)) <= NGINX_UPSTREAM_KEEPALIVE_S


# ---- the CPU decode kernel: a compiler in the CPU image, its cache on a writable volume ----
# portcullis/kernels/cpu_decode.py compiles the kernel on first use with the system's C++
# compiler into cache_dir(); without either, every decode takes the PyTorch path (issue 30).

CXX_PACKAGES = {"g++", "build-essential"}  # either puts g++ (and c++) on the PATH


def image_env(name: str, target: str) -> dict[str, str]:
    """The ENV of `target`'s image, later instructions winning."""
    env: dict[str, str] = {}
    for instruction, rest in image_of(name, target):
        if instruction == "ENV":
            env.update(word.partition("=")[::2] for word in shlex.split(rest))
    return env


def apt_installs(instructions: list[tuple[str, str]]) -> set[str]:
    return {word for run in runs(instructions) for words in shell_commands(run)
            if words[:2] == ["apt-get", "install"] for word in words[2:] if not word.startswith("-")}


def kernel_cache_dir(env: dict[str, str], monkeypatch) -> Path:
    """Where the kernel loader writes its builds under this environment."""
    from portcullis.kernels import cpu_decode

    for key in ("PORTCULLIS_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        if key in env:
            monkeypatch.setenv(key, env[key])
        else:
            monkeypatch.delenv(key, raising=False)
    return cpu_decode.cache_dir()


def test_cpu_engine_image_has_a_compiler_and_proves_the_kernel_builds():
    engine = image_of("Dockerfile", "engine")
    assert apt_installs(engine) & CXX_PACKAGES, "no C++ compiler: the engine never uses the native kernel"
    # Root is only for the install; the last USER is 10001 (test_dockerfile_runs_as_fixed_non_root_user).
    assert any("native_library()" in run for run in runs(engine)), (
        "the build must prove the kernel compiles and loads")
    assert not any("PORTCULLIS_CPU_ISA" in rest for _, rest in engine), (
        "a build pinned to the build machine's instruction set can fault on another CPU")
    assert not apt_installs(image_of("Dockerfile", "gateway")) & CXX_PACKAGES, "the gateway compiles nothing"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_kernel_cache_is_a_volume_the_image_user_can_write(name, monkeypatch):
    instructions = image_of(name, "engine")
    env = image_env(name, "engine")
    assert env.get("PORTCULLIS_CACHE_DIR") == "/var/cache/portcullis", "the images keep one layout"
    kernels = kernel_cache_dir(env, monkeypatch)
    assert not kernels.is_relative_to(env["HOME"]), "$HOME is on the read-only root filesystem"
    volumes = json.loads(next(rest for i, rest in instructions if i == "VOLUME"))
    assert any(kernels.is_relative_to(v) for v in volumes), f"{kernels} is not on a volume"
    owned = [words for run in runs(instructions) for words in shell_commands(run)
             if words[:2] == ["install", "-d"] and f"{IMAGE_UID}" in words]
    assert any(env["PORTCULLIS_CACHE_DIR"] in words for words in owned), (
        "a fresh named volume copies the folder's owner: it must be the image's user")


def compose_engines() -> list[tuple[str, str, dict[str, Any]]]:
    return [(name, service_name, service) for name in ("docker-compose.yml", "docker-compose.fleet.yml")
            for service_name, service in compose(name)["services"].items()
            if [str(a) for a in service.get("command") or []][:1] == ["engine"]]


def test_compose_engines_write_the_kernel_cache_to_a_volume(monkeypatch):
    built = built_images()
    engines = compose_engines()
    assert {service_name for _, service_name, _ in engines} >= {"engine", "engine-chat-1"}
    for name, service_name, service in engines:
        env = {**image_env(*built[service["image"]]), **(service.get("environment") or {})}
        kernels = kernel_cache_dir(env, monkeypatch)
        assert service["read_only"] is True
        writable = [target for target, read_only in mounts(service) if not read_only]
        assert any(kernels.is_relative_to(target) for target in writable), (
            f"{name}:{service_name}: {kernels} is read-only")
        # The compiler writes its temporary files to /tmp.
        assert any(t.split(":")[0] == "/tmp" for t in service["tmpfs"]), f"{name}:{service_name}"


def test_k8s_engines_write_the_kernel_cache_to_an_empty_dir(monkeypatch):
    built = built_images()
    fleet = [d for p in sorted((DEPLOY / "k8s-fleet").glob("engine-*.yaml"))
             for d in yaml.load_all(p.read_text(), Loader=LOADER) if d and d["kind"] == "StatefulSet"]
    workloads = [k8s_one("Deployment", ENGINE), *fleet]
    assert len(workloads) > 1
    for workload in workloads:
        c = container(workload)
        env = {**image_env(*built[c["image"]]), **{e["name"]: e.get("value") for e in c.get("env", [])}}
        kernels = kernel_cache_dir(env, monkeypatch)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        for path in (kernels, Path("/tmp/cc.o")):  # the compiler's temporary files go to /tmp
            where = f"{workload['metadata']['name']}: {path}"
            assert any(path.is_relative_to(m["mountPath"]) for m in c["volumeMounts"]), f"{where} is read-only"
            mount, volume = volume_for(workload, str(path))
            assert not mount.get("readOnly") and "emptyDir" in volume, where


def test_systemd_engine_writes_the_kernel_cache_to_its_cache_directory(monkeypatch):
    service = unit(ENGINE_UNIT)["Service"]
    env = dict(value.partition("=")[::2] for value in service["Environment"])
    kernels = kernel_cache_dir(env, monkeypatch)
    assert kernels.is_relative_to(Path("/var/cache") / last(service, "CacheDirectory"))
    assert kernels == kernel_cache_dir(image_env("Dockerfile", "engine"), monkeypatch), "the images' layout"


# ---- the operator docs ---------------------------------------------------------------

# Words after which "portcullis" is a user, group or namespace name, not the program.
NAME_OPTIONS = {"-u", "-g", "-o", "-n", "--user", "--group", "--owner", "--namespace", "namespace"}


def readme_invocations() -> list[list[str]]:
    """Every `portcullis ...` invocation in deploy/README.md's shell blocks and inline full
    commands, as argv after the program: direct calls, `sudo -u portcullis .../bin/portcullis`,
    `kubectl exec ... -- portcullis`, and Compose's `cli` service (entrypoint portcullis)."""
    text = (DEPLOY / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    inline = re.findall(r"`((?:sudo|docker|kubectl) [^`]+)`", text)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()] + inline
    found = []
    for line in lines:
        for segment in re.split(r"\|\||&&|\||;", line):
            try:
                words = shlex.split(segment, comments=True)
            except ValueError:
                continue  # a fragment of a quoted string cut by the split above
            for i, word in enumerate(words):
                program = word.endswith("/bin/portcullis") or (
                    word == "portcullis" and (i == 0 or words[i - 1] not in NAME_OPTIONS))
                if program or words[i:i + 3] == ["run", "--rm", "cli"]:
                    found.append(words[i + (1 if program else 3):])
                    break
    return found


def test_readme_commands_match_the_real_cli():
    invocations = readme_invocations()
    assert all(invocations), "a bare `portcullis` with no subcommand in the docs"
    seen = {argv[0] for argv in invocations}
    assert {"keys", "audit", "policy"} <= seen, f"the docs must show keys, audit and policy; found {seen}"
    assert any(argv[:2] == ["audit", "--policy"] and "verify" in argv for argv in invocations)
    assert any(argv[0] == "keys" and "rotate" in argv for argv in invocations)
    for argv in invocations:
        assert argv[0] in ("engine", "gateway", "keys", "audit", "policy"), f"unknown: portcullis {argv}"
        if argv[0] == "engine":
            parse_cli("engine", argv[1:])
        else:
            parse_cli("gateway-cli", argv)


def test_readme_kv_cache_example_is_right():
    text = (DEPLOY / "README.md").read_text()
    per_token = 2 * 28 * 4 * 128 * 2
    assert per_token == 57_344 and f"{per_token:,}" in text and "56 KiB" in text
    tokens = 40 * 2**30 // per_token
    assert f"{tokens:,}" in text
    assert f"**{40 * 2**30 // (8192 * per_token)} such requests**" in text


# ---- the audit keyring: outside the read-only policy folder and the audit volume -----------
# The gateway creates its keyring beside the policy unless told where it is; every deployment
# mounts the policy read-only, so each must hand it one (`--audit-keyring`) or it cannot start.

KEYRING_ENV = "PORTCULLIS_AUDIT_KEYRING"


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.fleet.yml"])
def test_compose_gateway_and_cli_share_the_keyring_secret(name):
    doc = compose(name)
    gateway, admin = doc["services"]["gateway"], doc["services"]["cli"]
    path = flag_value([str(a) for a in gateway["command"]], "--audit-keyring")
    assert path == "/run/secrets/audit_keyring" and "audit_keyring" in gateway["secrets"]
    assert set(doc["secrets"]["audit_keyring"]) == {"file"}
    assert doc["secrets"]["audit_keyring"]["file"].startswith("./secrets/"), "a file beside the engine token"
    # `portcullis keys` in the cli service audits each change under the gateway's keys.
    assert gateway["environment"][KEYRING_ENV] == admin["environment"][KEYRING_ENV] == path
    assert "audit_keyring" in admin["secrets"]
    assert ("/var/lib/portcullis", False) in mounts(admin), "key changes are written to the audit log"
    assert not any(Path(path).is_relative_to(target) for target, _ in mounts(gateway))


def test_k8s_gateway_reads_a_0600_copy_of_the_keyring_secret():
    gateway = k8s_one("Deployment", GATEWAY)
    pod = gateway["spec"]["template"]["spec"]
    path = flag_value(container(gateway)["args"], "--audit-keyring")
    mount, volume = volume_for(gateway, path)
    assert mount.get("readOnly") and volume["emptyDir"]["medium"] == "Memory", "kept off the node's disk"
    audit_mount, _ = volume_for(gateway, "/var/lib/portcullis/audit/audit.log")
    assert audit_mount["name"] != mount["name"], "whoever may rewrite the log must not find the key beside it"
    [init] = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secrets = [volumes[m["name"]]["secret"] for m in init["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert [s["secretName"] for s in secrets] == ["portcullis-audit-keyring"]
    assert init["command"][:3] == ["install", "-m", "0600"] and init["command"][-1] == path
    assert any(m["name"] == mount["name"] and not m.get("readOnly") for m in init["volumeMounts"])
    sc = init["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e.get("value") for e in container(gateway)["env"]}
    assert env[KEYRING_ENV] == path, "`kubectl exec ... portcullis audit verify` finds it too"


def test_the_keyring_placeholder_fails_closed(tmp_path):
    from portcullis.gateway.audit.keys import AuditKeyring, KeyringError

    text = k8s_one("Secret", "portcullis-audit-keyring")["stringData"]["audit-keyring.json"]
    assert "REPLACE" in text
    (tmp_path / "keyring.json").write_text(text)
    (tmp_path / "keyring.json").chmod(0o600)
    with pytest.raises(KeyringError):
        AuditKeyring.load_or_create(tmp_path / "keyring.json")


def test_a_read_only_policy_folder_needs_audit_keyring(tmp_path, monkeypatch, capsys):
    """The deployment policy where no keyring can be created beside it (in the containers a
    read-only mount; here a file where its secrets/ folder would go, as tests run as root)."""
    from portcullis import cli

    policy = yaml.safe_load((DEPLOY / "config" / "policy.yaml").read_text())
    policy["audit"]["path"] = str(tmp_path / "audit" / "audit.log")
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "policy.yaml").write_text(yaml.safe_dump(policy))
    (folder / "keys.yaml").write_text("version: 1\nkeys: []\n")
    (folder / "secrets").write_text("")
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", "x" * 32)
    monkeypatch.delenv(KEYRING_ENV, raising=False)
    started = []
    monkeypatch.setattr(cli.gateway, "_serve", lambda settings, token: started.append(settings))
    argv = ["gateway", "--policy", str(folder / "policy.yaml"), "--engine-url", "http://127.0.0.1:9"]
    assert cli.main(argv) == 2 and not started
    err = capsys.readouterr().err
    assert "cannot create the audit keyring" in err and "--audit-keyring" in err
    keyring = tmp_path / "keyring" / "audit-keyring.json"
    assert cli.main(["audit", "init-keyring", str(keyring)]) == 0
    assert cli.main([*argv, "--audit-keyring", str(keyring)]) == 0
    assert started[0].audit_keyring == keyring


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.fleet.yml"])
def test_compose_keyring_step_runs_on_a_fresh_checkout(name):
    """The service that writes the keyring must not mount it as a secret: Compose refuses to
    start a service whose secret file is missing, and on a fresh checkout that is this file."""
    doc = compose(name)
    makers = [(s, svc) for s, svc in doc["services"].items()
              if "init-keyring" in [str(a) for a in svc.get("command") or []]]
    assert len(makers) == 1, f"{name}: one service writes the audit keyring, found {[s for s, _ in makers]}"
    service_name, service = makers[0]
    assert not service.get("secrets"), f"{name}:{service_name} mounts a secret it may be making"
    assert "admin" in service.get("profiles", []), "a one-off: `up` must not start it"
    assert service.get("network_mode") == "none"
    argv = [str(a) for a in service["command"]]
    parse_cli("gateway-cli", argv)
    written = Path(argv[argv.index("init-keyring") + 1])
    binds = [v.split(":") for v in service.get("volumes", []) if v.startswith("./")]
    [(source, target, *_)] = [b for b in binds if written.is_relative_to(b[1])]
    host_file = Path(source) / written.relative_to(target)
    assert Path(doc["secrets"]["audit_keyring"]["file"]) == host_file, "it writes where the secret is read"
    assert (DEPLOY / source).is_dir(), f"{source} must be in a checkout: a missing bind source refuses to start"


def test_readme_and_compose_headers_run_the_keyring_service_before_up():
    text = (DEPLOY / "README.md").read_text()
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.DOTALL) if "docker compose up -d" in b)
    procedures = {"README.md": block.splitlines()}
    for name in ("docker-compose.yml", "docker-compose.fleet.yml"):
        procedures[name] = [line.removeprefix("#").strip() for line in (DEPLOY / name).read_text().splitlines()
                            if line.startswith("#   ")]
    for where, lines in procedures.items():
        commands = [shlex.split(line, comments=True) for line in lines if line.strip()]
        docker_compose = [i for i, words in enumerate(commands) if words[:2] == ["docker", "compose"]]
        compose_runs = [i for i in docker_compose if "run" in commands[i]]
        keyring = [i for i in compose_runs if commands[i][-1] == "keyring"]
        up = [i for i in docker_compose if "up" in commands[i]]
        assert keyring and up and keyring[0] < up[0], f"{where}: the keyring service runs before `up`"
        assert not any("init-keyring" in commands[i] for i in compose_runs if i not in keyring), (
            f"{where}: init-keyring through a service that mounts the keyring secret refuses to start")

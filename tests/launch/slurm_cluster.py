"""A real two-node SLURM cluster on this machine, for the launch tests: munged, slurmctld and two
slurmd "nodes" (n0 on 127.0.0.10, n1 on 127.0.0.11), all with private sockets, ports, state and logs
under one directory. Only the daemons started here are stopped (by their own PIDs).

    with SlurmCluster(tmp_dir) as cluster:
        subprocess.run(["sbatch", ...], env=cluster.env)

Needs the Debian packages slurm-wlm and munge (.ci/run installs them) and root (the daemons run as root).

`gpus_per_node=N` gives each node N GPUs as SLURM sees them (GRES gpu, on device files made under the
cluster's directory: nothing opens them), for checking which steps get which GPUs; no GPU is needed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from moe_rl.train.parallel import free_port

NODES = {"n0": "127.0.0.10", "n1": "127.0.0.11"}
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]


def _free_ports(n: int) -> list[int]:
    """n distinct ports, free now, outside the range outgoing connections take."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port("127.0.0.1"))
    return sorted(ports)


def _which(b: str) -> str:
    return shutil.which(b) or f"/usr/sbin/{b}"


class SlurmCluster:
    def __init__(self, root: str | Path, cpus_per_node: int = 2, memory_mb: int = 8000,
                 gpus_per_node: int = 0):
        self.root = Path(root)
        self.cpus, self.memory, self.gpus = cpus_per_node, memory_mb, gpus_per_node
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- configuration ------------------------------------------------------------------------------

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool-n0", "spool-n1", "logs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        host = socket.gethostname()
        lines = [
            "ClusterName=moerltest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r / 'munge.sock'}",
            "SlurmUser=root", "SlurmdUser=root", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "MpiDefault=none", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'logs/slurmctld.log'}", f"SlurmdLogFile={r}/logs/slurmd-%n.log",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=10",
            # `sbatch --wait` polls a job after 2 s, then every 8 s while MinJobAge is at most 16 (every 32 s
            # otherwise: a 20 s job was seen done at 42 s); a finished job's record outlives one poll
            "MinJobAge=16",
        ]
        gres = ""
        if self.gpus:  # SLURM's gpu plugin counts device files: character devices nvidiaK (NVIDIA's major)
            (r / "dev").mkdir(exist_ok=True)
            for k in range(self.gpus):
                if not (r / "dev" / f"nvidia{k}").exists():
                    os.mknod(r / "dev" / f"nvidia{k}", 0o600 | stat.S_IFCHR, os.makedev(195, k))
            (r / "gres.conf").write_text(f"Name=gpu File={r}/dev/nvidia[0-{self.gpus - 1}]\n")
            lines.append("GresTypes=gpu")
            gres = f" Gres=gpu:{self.gpus}"
        for (name, ip), port in zip(NODES.items(), node_ports, strict=True):
            lines.append(f"NodeName={name} NodeAddr={ip} NodeHostname={host} Port={port} CPUs={self.cpus} "
                         f"RealMemory={self.memory}{gres} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # -- daemons ------------------------------------------------------------------------------------

    def _start(self, argv: list[str], log: str) -> None:
        with open(self.root / "logs" / log, "ab") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                               start_new_session=True))

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"SLURM/munge binaries missing ({', '.join(missing)}): "
                               "apt-get install slurm-wlm slurmctld slurmd slurm-client munge")
        try:
            return self._start_daemons(timeout_s)
        except BaseException:
            self.stop()  # the daemons started so far (a `with` block's __exit__ does not run)
            raise

    def _start_daemons(self, timeout_s: float) -> SlurmCluster:
        self._write_config()
        r = self.root
        key = r / "munge.key"  # this cluster's own key
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._start([_which("munged"), "--foreground", "--force", f"--socket={r / 'munge.sock'}",
                     f"--pid-file={r / 'munged.pid'}", f"--seed-file={r / 'munge.seed'}",
                     f"--log-file={r / 'logs/munged.log'}", f"--key-file={key}"], "munged.out")
        self._wait(lambda: (r / "munge.sock").exists(), timeout_s, "munged")
        self._start([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for name in NODES:
            self._start([_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}.out")
        self._wait(self._nodes_idle, timeout_s, "two idle slurmd nodes")
        return self

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                             env=self.env)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n, "").startswith("idle") for n in NODES)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} while waiting for {what}; "
                                       f"logs: {self.logs()}")
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}; logs: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
                         for f in sorted((self.root / "logs").glob("*")))

    def cancel_jobs(self, timeout_s: float = 90.0) -> None:
        """Cancel every job of this cluster and wait for them to end (their steps outlive slurmd)."""
        def queued() -> list[str]:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env)
            return out.stdout.split()

        jobs = queued()
        if jobs:
            subprocess.run(["scancel", *jobs], env=self.env)
        deadline = time.monotonic() + timeout_s
        while queued() and time.monotonic() < deadline:
            time.sleep(1)

    def stop(self) -> None:
        """Cancel the cluster's jobs, then stop the daemons started here (slurmd, slurmctld, munged)."""
        if self.procs:
            self.cancel_jobs()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

#!/usr/bin/env bash
# System packages for the SLURM launch tests: slurm-wlm (slurmctld, slurmd, client) and munge.
# Idempotent: does nothing when the binaries are there. Installs with apt-get as root (or sudo -n).
set -euo pipefail
need=(munged slurmctld slurmd sbatch srun squeue scancel scontrol sinfo)
missing=()
for b in "${need[@]}"; do command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b"); done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup_slurm: installing slurm-wlm and munge (missing: ${missing[*]})"
if [ "$(id -u)" -eq 0 ]; then as_root=(); elif sudo -n true 2>/dev/null; then as_root=(sudo -n); else
  echo "setup_slurm: need root (or passwordless sudo) to apt-get install slurm-wlm slurmctld slurmd slurm-client munge" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get install -y -q slurm-wlm slurmctld slurmd slurm-client munge >/dev/null ||
  { "${as_root[@]}" apt-get update -q >/dev/null && "${as_root[@]}" apt-get install -y -q slurm-wlm slurmctld slurmd slurm-client munge >/dev/null; }
echo "setup_slurm: done"

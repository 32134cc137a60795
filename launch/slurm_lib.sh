# The SLURM side of launch/slurm_ray.sbatch (sourced by it; tests/launch/test_slurm_lib.py runs each function
# on its own): the Slurm version it needs, each node's IPv4 address, and the srun of each step with the
# GPUs that step asks for. A function that fails prints one line saying why on stdout and returns 1, so
# that the caller can log it: `ip=$(node_ip n0) || { log "$ip"; exit 1; }`.

SLURM_MIN_VERSION=20.11  # `srun --overlap` (steps sharing the job's CPUs): Slurm 20.11

# 0 when `srun --version` reports Slurm 20.11 or newer ("slurm 23.11.4", Debian's "slurm-wlm 22.05.8")
check_slurm_version() {
  local text version major minor
  text=$(srun --version 2>&1)
  version=$(sed -nE 's/^slurm[-a-z]* ([0-9]+\.[0-9]+(\.[0-9]+)?).*/\1/p' <<<"$text" | head -n 1)
  if [[ -z "$version" ]]; then
    echo "could not read the Slurm version from 'srun --version' (${text:-no output});" \
      "launch/slurm_ray.sbatch needs Slurm >= $SLURM_MIN_VERSION"
    return 1
  fi
  IFS=. read -r major minor _ <<<"$version"
  if (( 10#$major < 20 || (10#$major == 20 && 10#$minor < 11) )); then
    echo "Slurm $version is too old: launch/slurm_ray.sbatch needs Slurm >= $SLURM_MIN_VERSION (srun --overlap)"
    return 1
  fi
  echo "$version"
}

is_ipv4() {
  local IFS=. part parts
  [[ "$1" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || return 1
  read -r -a parts <<<"$1"
  for part in "${parts[@]}"; do (( 10#$part <= 255 )) || return 1; done
}

# The IPv4 address of a node of the job, for Ray's --node-ip-address: its NodeAddr (scontrol), which
# may be a host name (it is the NodeName where slurm.conf gives none), resolved with getent ahostsv4
node_ip() {
  local node=$1 addr ip
  addr=$(scontrol show node -o "$node" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
  if [[ -z "$addr" ]]; then
    echo "node $node: 'scontrol show node $node' gives no NodeAddr"
    return 1
  fi
  if is_ipv4 "$addr"; then
    echo "$addr"
    return 0
  fi
  ip=$(getent ahostsv4 "$addr" 2>/dev/null | awk 'NR==1{print $1}')
  if ! is_ipv4 "$ip"; then
    echo "node $node: its NodeAddr '$addr' does not resolve to an IPv4 address (getent ahostsv4 $addr)," \
      "which Ray's --node-ip-address needs; give the node an IPv4 NodeAddr in slurm.conf or make the name resolve"
    return 1
  fi
  echo "$ip"
}

# The GPU request of a step (srun option): a Ray node's step (ROLE ray) asks for the GPUs its Ray node
# offers, the driver's (ROLE driver) for none. Explicit, because by default a step gets every GPU the job
# has on its node, and before Slurm 22.05 `--overlap` shared only CPUs, so a driver step that asked for
# the GPUs waited for the Ray head's step to end. --gpus-per-node is the spelling Slurm 22.05 honours for
# a job given GPUs either way (sbatch --gpus-per-node=N or --gres=gpu:N): in a --gpus-per-node job, srun
# --gres=none is refused ("Invalid Trackable RESource (TRES) specification") and --gpus=0, --gres=gpu:0
# and --gpus-per-task=0 still hand the step every GPU.
step_gpu_args() {
  local role=$1 gpus=${2:-0}
  if [[ ! "$gpus" =~ ^[0-9]+$ ]]; then
    echo "GPUs per node '$gpus' (MOE_RL_GPUS_PER_NODE or SLURM_GPUS_ON_NODE): a whole number, 0 or more"
    return 1
  fi
  case "$role" in
    ray) echo "--gpus-per-node=$((10#$gpus))" ;;
    driver) echo "--gpus-per-node=0" ;;
    *) echo "step_gpu_args: the role is ray or driver, not '$role'"; return 1 ;;
  esac
}

# step ROLE NODE [srun options] COMMAND...: one task on NODE, sharing the allocation with the job's other
# steps (--overlap), with ROLE's GPUs (step_gpu_args with GPUS_PER_NODE) and the container options in the
# array STEP_CONTAINER_ARGS, if any. It execs srun, so that `step ... &` leaves srun's own PID in $!
# (signalling it reaches the step's task through srun).
step() {
  local role=$1 node=$2 gpu
  shift 2
  gpu=$(step_gpu_args "$role" "${GPUS_PER_NODE:-0}") || { echo "$gpu" >&2; exit 2; }
  exec srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --kill-on-bad-exit=0 "$gpu" \
    ${STEP_CONTAINER_ARGS[@]+"${STEP_CONTAINER_ARGS[@]}"} "$@"
}

# ray_cli NODE ARGS...: `ray ARGS` (RAY_BIN) where the job's Ray lives: where every step runs in a container
# (STEP_CONTAINER_ARGS), inside it, as a short step on NODE (the batch host may have no Ray, or another
# one); else here, on the batch host (the first node), with the job's environment.
ray_cli() {
  local node=$1
  shift
  if (( ${#STEP_CONTAINER_ARGS[@]} )); then
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --gpus-per-node=0 "${STEP_CONTAINER_ARGS[@]}" \
      "$RAY_BIN" "$@"
  else
    "$RAY_BIN" "$@"
  fi
}

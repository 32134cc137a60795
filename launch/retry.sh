# The retry rule of both launchers (sourced by launch/local.sh and launch/slurm_ray.sbatch).
#
# MOE_RL_RETRIES=N runs a stopped run again up to N times, from its last checkpoint
# (checkpoint.resume=auto), when it stopped because a process died or hung (moe-rl's exit code 3) or
# the driver itself was killed (exit code 128 + signal, e.g. 137 for SIGKILL). A success (0), a bug
# (1) or a user error (2: a config, data or checkpoint problem) is final: a retry would only repeat it.
RETRIES=${MOE_RL_RETRIES:-0}
[[ "$RETRIES" =~ ^[0-9]+$ ]] || { echo "MOE_RL_RETRIES=$RETRIES: a whole number of retries, 0 or more" >&2; exit 2; }

retryable() { (( $1 == 3 || $1 > 128 )); }

# The retry rule of both launchers (sourced by launch/local.sh and launch/slurm_ray.sbatch).
#
# MOE_RL_RETRIES=N runs a stopped run again up to N times when it stopped because a process died or
# hung (moe-rl's exit code 3) or the driver itself crashed or was killed (SIGABRT, SIGKILL, SIGSEGV:
# exit codes 134, 137, 139). A success (0), a bug (1), a user error (2: a config, data or checkpoint
# problem) or an interruption (130, 143) is final: a retry would repeat it, or override the user.
#
# A retry resumes from the newest checkpoint the run wrote since its first try started
# (MOE_RL_RESUME_SINCE, read by moe_rl/driver/run_checkpoints.py), and as checkpoint.resume says when there is none.
RETRIES=${MOE_RL_RETRIES:-0}
[[ "$RETRIES" =~ ^[0-9]+$ ]] || { echo "MOE_RL_RETRIES=$RETRIES: a whole number of retries, 0 or more" >&2; exit 2; }
RETRIES=$((10#$RETRIES))
export MOE_RL_RESUME_SINCE=${MOE_RL_RESUME_SINCE:-$(date +%s)}

retryable() { [[ " 3 134 137 139 " == *" $1 "* ]]; }

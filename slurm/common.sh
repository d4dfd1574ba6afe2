# Sourced by the sbatch templates in this folder.
#
# sbatch runs a copy of the script from its spool directory, so the checkout is
# found through the directory the job was submitted from (or CLIPSCALE_DIR).
cd "${CLIPSCALE_DIR:-$SLURM_SUBMIT_DIR}" || exit 1
PYTHON=${PYTHON:-python}

# The first node of the allocation hosts the rendezvous, at the address Slurm
# itself reaches it by (NodeAddr, which is the node name unless slurm.conf says
# otherwise). The port is derived from the job id so that two jobs sharing a
# node do not collide, and a requeued job (same id) finds the same one.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_NODE=$(scontrol show node "$HEAD_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
RENDEZVOUS_PORT=${RENDEZVOUS_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# Run a job step so that a preemption notice stops it cleanly and requeues the job.
#
# `#SBATCH --signal=B:USR1@<seconds>` delivers the notice to this script only.
# The trap passes SIGTERM on to every task of the job's steps (scancel without
# --batch skips this script): the trainer then finishes its step, writes a
# checkpoint on all ranks alike and exits. Once the step has ended, the job is
# requeued; it keeps its id, and the trainer resumes from its newest checkpoint.
# A plain `scancel <job>` is not a notice: it ends the job for good.
run_requeueable() {
    local preempted=""
    trap 'preempted=1; echo "preemption notice: checkpointing"; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
    "$@" &
    local step=$!
    wait "$step"
    local status=$?
    if [[ -n $preempted ]]; then  # the trap interrupted `wait`; wait for the step itself
        wait "$step"
        status=$?
        echo "step ended with status $status; requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}

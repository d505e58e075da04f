#!/bin/sh
# Submit a training job to a Ray cluster (docs/multinode.md). Options go to dynmoe_dist.cluster.submit:
#   RAY_ADDRESS=http://HEAD:8265 launcher/ray_submit.sh --config launcher/configs/demo.toml --num-workers 2 \
#       [--use-gpu] [--storage-path /shared/dynmoe_runs] [--set section.key=value ...]
# On this machine alone, --local first starts a Ray head on 127.0.0.1 for the job and stops it afterwards
# (only its own processes; RAY_NUM_CPUS, RAY_PORT, RAY_DASHBOARD_PORT adjust it):
#   launcher/ray_submit.sh --local --config launcher/configs/demo.toml --num-workers 2
# PYTHON is the environment with dynmoe_dist and Ray here (default: the project's .venv, see
# launcher/python.sh); JOB_PYTHON the interpreter the job runs on the cluster (default: python; with
# --local: PYTHON). The job runs in a copy of this repository, so relative paths start from its root.
# The config is checked here first, before a head starts or anything is submitted, and so is every path
# the run names: a relative one must be in the upload (runs/ is not: name a model trained there by its
# absolute path on storage every node reads; with --local, this machine's). A mistake is one line
# `dynmoe-train: error: ...` and exit status 2. The check prints where the run's files will be
# (default ~/dynmoe_runs/NAME, NAME the basename of output.out_dir); the job ends with the summary torchrun
# prints (report, checkpoint, export command).
set -eu
. "$(dirname "$0")/python.sh"
cd "$(dirname "$0")/.."
RUNTIME_ENV=cluster/runtime_env.yaml
LOCAL=0
if [ "${1:-}" = "--local" ]; then
    LOCAL=1
    shift
fi
"$PYTHON" -m dynmoe_dist.cluster.submit --check --working-dir . --runtime-env "$RUNTIME_ENV" "$@" || exit $?
if [ "$LOCAL" = 1 ]; then
    # Ray keeps 127.0.0.1 instead of rewriting it to the machine's outward address.
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 MASTER_ADDR=127.0.0.1
    TEMP_DIR=$(mktemp -d /tmp/dmray-XXXXXX)
    # Only this head's processes are stopped. After a job's one error line (exit status 2) quietly, so that
    # the error stays the last line.
    stop_head() {
        status=$?
        if [ "$status" = 2 ]; then
            "$PYTHON" -m dynmoe_dist.cluster.local stop --temp-dir "$TEMP_DIR" >/dev/null 2>&1 || true
        else
            "$PYTHON" -m dynmoe_dist.cluster.local stop --temp-dir "$TEMP_DIR" || true
        fi
        rm -rf "$TEMP_DIR"
    }
    trap stop_head EXIT
    trap 'exit 130' INT TERM
    "$PYTHON" -m dynmoe_dist.cluster.local start --temp-dir "$TEMP_DIR" --num-cpus "${RAY_NUM_CPUS:-2}" \
        --port "${RAY_PORT:-6380}" --dashboard-port "${RAY_DASHBOARD_PORT:-8265}"
    RAY_ADDRESS=http://127.0.0.1:${RAY_DASHBOARD_PORT:-8265}
    # Absolute: the job runs in Ray's unpacked copy of the working dir, where a relative path is wrong.
    JOB_PYTHON=${JOB_PYTHON:-$("$PYTHON" -c 'import sys; print(sys.executable)')}
fi
: "${RAY_ADDRESS:?set RAY_ADDRESS=http://HEAD:8265 (the head's dashboard address), or pass --local}"
# `python -m ray.scripts.scripts` is the `ray` command of PYTHON's environment. The relay ends the output
# with the job's one error line (exit status 2) instead of Ray's failure report.
"$PYTHON" -m dynmoe_dist.cluster.relay "$PYTHON" -m ray.scripts.scripts job submit --address "$RAY_ADDRESS" \
    --working-dir . --runtime-env "$RUNTIME_ENV" -- \
    "${JOB_PYTHON:-python}" -m dynmoe_dist.cluster.submit "$@"

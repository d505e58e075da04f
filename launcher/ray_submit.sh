#!/bin/sh
# Submit a training job to a Ray cluster (docs/multinode.md). Options go to dynmoe_dist.cluster.submit:
#   RAY_ADDRESS=http://HEAD:8265 launcher/ray_submit.sh --config launcher/configs/demo.toml --num-workers 2 \
#       [--use-gpu] [--storage-path /shared/dynmoe_runs] [--set section.key=value ...]
# On this machine alone, --local first starts a Ray head on 127.0.0.1 for the job and stops it afterwards
# (only its own processes; RAY_NUM_CPUS, RAY_PORT, RAY_DASHBOARD_PORT adjust it):
#   launcher/ray_submit.sh --local --config launcher/configs/demo.toml --num-workers 2
# PYTHON is the environment with dynmoe_dist and Ray here; JOB_PYTHON the interpreter the job runs on the
# cluster (default: python; with --local: PYTHON).
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [ "${1:-}" = "--local" ]; then
    shift
    # Ray keeps 127.0.0.1 instead of rewriting it to the machine's outward address.
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 MASTER_ADDR=127.0.0.1
    TEMP_DIR=$(mktemp -d /tmp/dmray-XXXXXX)
    trap '"$PYTHON" -m dynmoe_dist.cluster.local stop --temp-dir "$TEMP_DIR"; rm -rf "$TEMP_DIR"' EXIT
    trap 'exit 130' INT TERM
    "$PYTHON" -m dynmoe_dist.cluster.local start --temp-dir "$TEMP_DIR" --num-cpus "${RAY_NUM_CPUS:-2}" \
        --port "${RAY_PORT:-6380}" --dashboard-port "${RAY_DASHBOARD_PORT:-8265}"
    RAY_ADDRESS=http://127.0.0.1:${RAY_DASHBOARD_PORT:-8265}
    # Absolute: the job runs in Ray's unpacked copy of the working dir, where a relative path is wrong.
    JOB_PYTHON=${JOB_PYTHON:-$("$PYTHON" -c 'import sys; print(sys.executable)')}
fi
: "${RAY_ADDRESS:?set RAY_ADDRESS=http://HEAD:8265 (the head's dashboard address), or pass --local}"
# `python -m ray.scripts.scripts` is the `ray` command of PYTHON's environment.
"$PYTHON" -m ray.scripts.scripts job submit --address "$RAY_ADDRESS" --working-dir . \
    --runtime-env cluster/runtime_env.yaml -- "${JOB_PYTHON:-python}" -m dynmoe_dist.cluster.submit "$@"

#!/bin/sh
# One node: `launcher/torchrun.sh N [dynmoe-train options...]`, e.g.
#   launcher/torchrun.sh 2 --config launcher/configs/demo.toml --set parallel.ep_size=2
# Every rank listens on and contacts 127.0.0.1 only (standalone rendezvous). Extra torchrun flags
# (e.g. --max-restarts 3) go in TORCHRUN_ARGS. The config is checked once before any rank starts, and a
# mistake is one line `dynmoe-train: error: ...` with exit status 2 (dynmoe_dist/train/launch.py).
# The interpreter: PYTHON if set, else the project's .venv, else python3 (launcher/python.sh).
set -eu
NPROC=${1:?usage: launcher/torchrun.sh NPROC [dynmoe-train options]}
shift
export MASTER_ADDR=127.0.0.1
. "$(dirname "$0")/python.sh"
export DYNMOE_LAUNCH_COMMAND="${DYNMOE_LAUNCH_COMMAND:-$0}"  # the resume line after a stop names it
exec "$PYTHON" -m dynmoe_dist.train.launch "$NPROC" "$@"

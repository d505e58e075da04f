#!/bin/sh
# One node: `launcher/torchrun.sh N [dynmoe-train options...]`, e.g.
#   launcher/torchrun.sh 2 --config launcher/configs/demo.toml --set parallel.ep_size=2
# Every rank listens on and contacts 127.0.0.1 only (standalone rendezvous). Extra torchrun flags
# (e.g. --max-restarts 3) go in TORCHRUN_ARGS.
set -eu
NPROC=${1:?usage: launcher/torchrun.sh NPROC [dynmoe-train options]}
shift
export MASTER_ADDR=127.0.0.1
PYTHON=${PYTHON:-python}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
    -m dynmoe_dist.train "$@"

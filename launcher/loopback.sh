#!/bin/sh
# Run a command where only 127.0.0.1 exists: a fresh network namespace with just `lo` when we are root
# and unshare works, otherwise a plain run. Ray needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 so that it
# keeps 127.0.0.1 instead of rewriting it to the machine's outward address.
export MASTER_ADDR=127.0.0.1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Without a resolver in the namespace, c10d logs "The hostname of the client socket cannot be retrieved"
# for every connection; its C++ warnings say nothing else here (errors still show).
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null && command -v ip >/dev/null 2>&1; then
    exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$@"
fi
exec "$@"

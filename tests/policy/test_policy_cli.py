"""`megatron-recover plan`: the issue's two acceptance scenarios and the bad-input errors.

Pure Python, no hardware: `python -m pytest tests/policy/test_policy_cli.py -q`.
Most tests drive `plan_cli` through its own argparse parser (the contract `cli.py` relies on);
one runs the real entry point, `python -m megatron_recover.cli plan`, in a subprocess.
"""

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from megatron_recover.policy import plan_cli

REPO = pathlib.Path(__file__).resolve().parents[2]
REQUIRED_FIELDS = {
    "iteration", "live_replicas", "grad_accum", "num_major", "num_minor", "num_major_spare",
    "num_minor_spare", "num_boundary_minor", "minor_microbatches", "boundary",
    "extra_microbatches", "contributions", "roles", "ran", "per_replica_ids", "per_replica",
    "committed_ids",
}


def plan(capsys, *argv):
    """Run `plan` with argv; return (exit status, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="megatron-recover plan")
    plan_cli.add_arguments(parser)
    try:
        status = plan_cli.run(parser.parse_args(list(argv)))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def plan_json(capsys, *argv):
    status, out, err = plan(capsys, *argv, "--json")
    assert status == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    for record in records:
        assert REQUIRED_FIELDS <= set(record)
    return records


BASE = ("--w-init", "32", "--g-init", "8", "--iterations", "5")


def test_acceptance_one_failure(capsys):
    records = plan_json(capsys, *BASE, "--fail", "1:31")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    first = records[0]
    assert first["boundary"] is True and first["extra_microbatches"] == 1
    assert sorted(first["per_replica"].values()) == [8] * 23 + [9] * 8
    assert first["num_major"] == 8 and first["num_boundary_minor"] == 23
    assert first["live_replicas"] == 31 and "31" not in first["per_replica"]
    for later in records[1:]:
        assert later["grad_accum"] == 9 and later["num_major"] == 28
        assert later["num_minor"] == 1 and later["minor_microbatches"] == 4
        assert later["num_major_spare"] == 1 and later["num_minor_spare"] == 1
        assert later["boundary"] is False
    for record in records:
        assert record["contributions"] == 256
        assert record["committed_ids"] == list(range(256))
        ids = [i for per in record["per_replica_ids"].values() for i in per]
        assert sorted(ids) == record["committed_ids"]
        assert {k: len(v) for k, v in record["per_replica_ids"].items()} == record["per_replica"]


def test_acceptance_minor_spare_absorbs_the_minor(capsys):
    roles = plan_json(capsys, *BASE, "--fail", "1:31")[1]["roles"]
    (minor,) = [r for r, role in roles.items() if role == "minor"]
    (minor_spare,) = [r for r, role in roles.items() if role == "minor_spare"]
    records = plan_json(capsys, *BASE, "--fail", "1:31", "--fail", f"3:{minor}")
    reference = plan_json(capsys, *BASE)
    third = records[2]
    assert third["boundary"] is False and third["extra_microbatches"] == 0
    assert third["contributions"] == 256
    assert third["committed_ids"] == reference[2]["committed_ids"] == list(range(256))
    assert third["promoted"] == {minor: int(minor_spare)}
    assert third["roles"][minor_spare] == "minor" and minor not in third["roles"]
    assert third["num_minor_spare"] == 0 and third["live_replicas"] == 30
    assert all(r["contributions"] == 256 for r in records)


def test_table_output(capsys):
    status, out, err = plan(capsys, *BASE, "--fail", "1:31")
    assert status == 0 and not err
    lines = out.splitlines()
    assert "B=256" in lines[0] and lines[1].split()[:3] == ["iter", "live", "G"]
    assert len(lines) == 2 + 5
    assert "31 died @reduce" in lines[2] and "yes" in lines[2]


def test_adaptive_and_reserve_run(capsys):
    adaptive = plan_json(capsys, *BASE, "--policy", "adaptive", "--fail", "1:31")
    assert [r["contributions"] for r in adaptive] == [248] * 5
    assert all(not r["boundary"] and r["divisor"] == 248 for r in adaptive)
    reserve = plan_json(capsys, *BASE, "--mode", "reserve", "--fail", "1:31", "--fail", "3:5")
    assert all(r["contributions"] == 256 for r in reserve)
    assert reserve[2]["boundary"] is False and reserve[2]["promoted"] == {"5": 29}


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--w-init", "0", "--g-init", "8", "--iterations", "2"), "--w-init"),
        (("--w-init", "4", "--g-init", "-1", "--iterations", "2"), "--g-init"),
        (
            ("--w-init", "4", "--g-init", "8", "--iterations", "2", "--fail", "1:4"),
            "does not exist",
        ),
        (
            ("--w-init", "4", "--g-init", "8", "--iterations", "3", "--fail", "1:3",
             "--fail", "2:3"),
            "already dead",
        ),
        (
            ("--w-init", "4", "--g-init", "8", "--iterations", "3", "--fail", "2:1@extension"),
            "no extension pass",
        ),
        (
            ("--w-init", "32", "--g-init", "8", "--iterations", "3", "--fail", "1:31",
             "--fail", "2:28@extension"),
            "no extension pass",
        ),
        (("--w-init", "4", "--g-init", "8", "--iterations", "3", "--fail", "2:0,1,2,3"),
         "cannot continue"),
        (
            ("--w-init", "4", "--g-init", "8", "--iterations", "3", "--fail", "1:0,1@commit",
             "--fail", "2:2,3"),
            "cannot continue",
        ),
        (("--w-init", "4", "--g-init", "8", "--iterations", "3", "--fail", "1:2@commit",
          "--fail", "1:0,1,3@commit"), "cannot continue"),
        (("--w-init", "4", "--g-init", "8", "--iterations", "2", "--fail", "3:1"), "1..2"),
        (("--w-init", "4", "--g-init", "8", "--iterations", "2", "--fail", "one"), "ITER:REPLICA"),
        (("--w-init", "4", "--g-init", "8", "--iterations", "2", "--policy", "adaptive",
          "--mode", "reserve"), "static policy only"),
        (("--w-init", "4", "--g-init", "8", "--iterations", "2", "--policy", "adaptive",
          "--fail", "1:1", "--fail", "1:2@extension"), "no extension pass"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, message):
    status, out, err = plan(capsys, *argv)
    assert status == 2
    assert out == ""
    assert message in err and "error" in err


def test_entry_point_runs_plan():
    pytest.importorskip("megatron_recover.launch", reason="cli.py also imports the launch layer")
    cmd = [sys.executable, "-m", "megatron_recover.cli", "plan", *BASE, "--fail", "1:31", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[0]["extra_microbatches"] == 1 and records[1]["grad_accum"] == 9
    bad = subprocess.run(
        cmd[:4] + ["--w-init", "4", "--g-init", "2", "--iterations", "2", "--fail", "1:0,1,2,3"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2 and "cannot continue" in bad.stderr and bad.stdout == ""

"""Unit tests of the policy layer: id sets, Algorithm 7, the static policy's cases the paper leaves
implicit, reserve and adaptive behaviour, per-rank queries, the microbatch calculator, and the
architectural rule that the layer is pure Python.

Pure Python, no hardware: `python -m pytest tests/policy/test_policy_units.py -q`.
"""

import ast
import inspect
import json
import pathlib
import subprocess
import sys

import pytest

from megatron_recover.policy import (
    BLOCKING,
    BOUNDARY_MINOR,
    MAJOR,
    NON_BLOCKING,
    FailureEvent,
    IdSet,
    NoSurvivorsError,
    PolicyConfig,
    PolicyNumMicroBatchesCalculator,
    WorkloadPolicy,
    advance_layout,
    parse_failure,
    simulate,
)
from megatron_recover.policy import static

POLICY_DIR = pathlib.Path(__file__).resolve().parents[2] / "megatron_recover" / "policy"


def _steady_32x8(mode="exact"):
    """A policy past the appendix E boundary: 28 majors at 9, minor 28 at 4, spares 29 and 30."""
    policy = WorkloadPolicy(PolicyConfig(32, 8, mode=mode))
    policy.begin(1)
    policy.on_failure([31])
    policy.commit()
    return policy


# --- IdSet -----------------------------------------------------------------------------------


def test_idset_canonical_form_and_operations():
    a = IdSet.range(0, 4) | IdSet.range(4, 6) | IdSet.of([10, 8, 9])
    assert a.spans == ((0, 6), (8, 11)) and len(a) == 9
    assert a == IdSet.of([0, 1, 2, 3, 4, 5, 8, 9, 10])
    head, tail = a.take(7)
    assert head == IdSet.of([0, 1, 2, 3, 4, 5, 8]) and tail == IdSet.of([9, 10])
    assert head.issubset(a) and not a.issubset(head)
    assert head.isdisjoint(tail) and not head.isdisjoint(a)
    assert IdSet.union_all([head, tail]) == a
    assert 9 in a and 7 not in a and a.first() == 0
    assert IdSet.range(5, 5) == IdSet() and not IdSet()
    with pytest.raises(ValueError):
        a.take(10)
    with pytest.raises(ValueError):
        IdSet().first()
    with pytest.raises(AssertionError):
        IdSet(((3, 4), (0, 1)))


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(w_init=0, g_init=8), "w_init"),
        (dict(w_init=4, g_init=0), "g_init"),
        (dict(w_init=True, g_init=8), "w_init"),
        (dict(w_init=4, g_init=8, policy="elastic"), "policy"),
        (dict(w_init=4, g_init=8, mode="lossy"), "mode"),
        (dict(w_init=4, g_init=8, policy="adaptive", mode="reserve"), "static policy only"),
    ],
)
def test_config_rejects_user_mistakes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)


# --- Algorithm 7 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w_cur, b, g, n_maj, r, n_ms, n_mis",
    [
        (31, 256, 9, 28, 4, 1, 1),  # appendix E
        (30, 256, 9, 28, 4, 1, 0),  # one spare left: it is a major-spare
        (29, 256, 9, 28, 4, 0, 0),
        (28, 256, 10, 25, 6, 1, 1),
        (7, 64, 10, 6, 4, 0, 0),
        (3, 4, 2, 2, 0, 1, 0),  # no minor: all spares are major-spares
        (5, 12, 3, 4, 0, 1, 0),
        (1, 256, 256, 1, 0, 0, 0),  # one survivor does everything
    ],
)
def test_algorithm7_table(w_cur, b, g, n_maj, r, n_ms, n_mis):
    layout = advance_layout(range(w_cur), b)
    assert (layout.g_cur, len(layout.majors), layout.r_cur) == (g, n_maj, r)
    assert (len(layout.major_spares), len(layout.minor_spares)) == (n_ms, n_mis)
    assert (layout.minor is not None) == (r > 0)
    # Roles go out in replica order: majors, minor, major-spares, minor-spare.
    assert list(layout.majors) == list(range(n_maj))


def test_algorithm7_keeps_original_replica_ids():
    layout = advance_layout([30, 2, 17, 5], 10)  # G=3, 3 majors, minor at 1, no spare
    assert layout.majors == (2, 5, 17) and layout.minor == 30 and layout.r_cur == 1


# --- static policy: what the paper leaves implicit --------------------------------------------


def test_several_replicas_die_in_one_iteration():
    policy = WorkloadPolicy(PolicyConfig(32, 8))
    policy.begin(1)
    decision = policy.on_failure([17, 3, 31])
    # C_cur = 29*8 = 232; G_ext = 1; boundary minors = 232 + 29 - 256 = 5.
    assert decision.pool == 24 and decision.g_ext == 1 and decision.num_boundary_minor == 5
    recomputed = IdSet.union_all(policy.work(r).extension for r in policy.state.live)
    assert recomputed == IdSet.range(24, 32) | IdSet.range(136, 144) | IdSet.range(248, 256)
    result = policy.commit()
    assert result.committed == IdSet.range(0, 256)
    assert result.failed == {3, 17, 31}
    assert result.next_layout.g_cur == 9  # Algorithm 7 with W_cur = 29


def test_failure_during_extension_recurses_until_one_survivor():
    """B=12: replica 3 dies at the reduce, 2 during the first extension, 1 during the second."""
    policy = WorkloadPolicy(PolicyConfig(4, 3))
    policy.begin(1)
    d1 = policy.on_failure([3])
    assert (d1.pool, d1.g_ext, d1.num_boundary_minor) == (3, 1, 0)
    extension = [policy.work(r).extension for r in (0, 1, 2)]
    assert extension == [IdSet.of([9]), IdSet.of([10]), IdSet.of([11])]
    # Replica 2 had not committed anything: its first pass [6, 9) and its extension id 11 return
    # to the pool. C_cur = 8 (replicas 0 and 1), W_cur = 2, G_ext = 2.
    d2 = policy.on_failure([2])
    assert (d2.pool, d2.g_ext, d2.num_boundary_minor) == (4, 2, 0)
    assert d2.restore_mode == NON_BLOCKING
    assert policy.work(0).extension == IdSet.of([6, 7])
    assert policy.work(1).extension == IdSet.of([8, 11])
    d3 = policy.on_failure([1])
    assert (d3.pool, d3.g_ext) == (6, 6)
    assert policy.work(0).contributed == IdSet.range(0, 12)
    result = policy.commit()
    assert result.extension_rounds == (1, 2, 6) and result.extra_microbatches == 9
    assert result.per_replica_ids == {0: IdSet.range(0, 12)}
    assert result.ran == {0: 3 + 1 + 2 + 6}
    assert (result.next_layout.g_cur, result.next_layout.majors) == (12, (0,))


def test_boundary_minor_runs_a_padding_microbatch():
    policy = WorkloadPolicy(PolicyConfig(32, 8))
    policy.begin(1)
    policy.on_failure([31])
    work = policy.work(30)
    assert work.role == BOUNDARY_MINOR and not work.extension and work.extension_padding == 1
    assert work.padding_id in work.first_pass and work.extension_microbatches == 1
    assert work.contributed == work.first_pass


def test_spare_dying_is_not_a_boundary():
    policy = _steady_32x8()
    policy.begin(2)
    decision = policy.on_failure([29])
    assert decision.restore_mode == BLOCKING and not decision.boundary and not decision.promotions
    result = policy.commit()
    assert result.committed == IdSet.range(0, 256) and not result.boundary
    assert result.next_layout.major_spares == () and result.next_layout.minor_spares == (30,)


def test_exact_mode_promotes_only_the_dead_replicas_own_shadow():
    policy = _steady_32x8("exact")
    policy.begin(2)
    assert policy.work(29).first_pass == policy.work(0).first_pass  # 29 shadows major 0
    decision = policy.on_failure([5])  # nobody shadows major 5
    assert decision.boundary and not decision.promotions
    # At the boundary the spares' shadow work is dropped; they share the pool like anyone.
    assert not policy.work(29).contributes_first_pass
    assert policy.commit().committed == IdSet.range(0, 256)

    policy = _steady_32x8("exact")
    policy.begin(2)
    decision = policy.on_failure([0])
    assert decision.promotions == ((0, 29),) and not decision.boundary
    assert policy.work(29).role == MAJOR and policy.work(29).contributed == IdSet.range(0, 9)
    result = policy.commit()
    assert result.committed == IdSet.range(0, 256)
    # Next iteration: majors in replica order, so 29 now takes the last major range.
    assert result.next_layout.majors == tuple(range(1, 28)) + (29,)


def test_reserve_mode_promotes_any_spare_of_the_role_and_drops_the_dead_ids():
    policy = _steady_32x8("reserve")
    # Iteration 1's boundary dropped replica 31's ids [248, 256) and drew 8 replacements from the
    # reserve stream, ids B + 0 .. B + 7; the spares of iteration 2 draw the next ones.
    policy.begin(2)
    assert policy.work(29).first_pass == IdSet.range(264, 273)
    assert policy.work(30).first_pass == IdSet.range(273, 277)
    decision = policy.on_failure([5])  # 29 shadows no one in reserve mode: any major-spare will do
    assert decision.promotions == ((5, 29),) and not decision.boundary
    result = policy.commit()
    assert result.contributions == 256
    assert result.committed == IdSet.range(0, 45) | IdSet.range(54, 256) | IdSet.range(264, 273)
    # The minor-spare's reserve ids were run but not committed; still, the next iteration draws
    # past every reserve id handed out so far.
    policy.begin(3)
    assert policy.work(30).first_pass == IdSet.range(277, 281)


def test_adaptive_drops_and_goes():
    policy = WorkloadPolicy(PolicyConfig(4, 3, policy="adaptive"))
    policy.begin(1)
    decision = policy.on_failure([1])
    assert decision.restore_mode == BLOCKING and not decision.boundary and decision.dropped == 3
    result = policy.commit()
    assert result.committed == IdSet.range(0, 3) | IdSet.range(6, 12)
    assert result.divisor == result.contributions == 9
    policy.begin(2)
    assert policy.work(2).first_pass == IdSet.range(6, 9)  # survivors keep their own slices
    assert policy.commit().committed == IdSet.range(0, 3) | IdSet.range(6, 12)


def test_failure_records_are_validated():
    policy = WorkloadPolicy(PolicyConfig(4, 2))
    policy.begin(1)
    with pytest.raises(ValueError, match="at least one"):
        policy.on_failure([])
    with pytest.raises(ValueError, match="does not exist"):
        policy.on_failure([4])
    policy.on_failure([2])
    with pytest.raises(ValueError, match="not live"):
        policy.on_failure([2])
    with pytest.raises(NoSurvivorsError, match="cannot continue"):
        policy.on_failure([0, 1, 3])
    with pytest.raises(ValueError, match="not live"):
        policy.work(2)


def test_workload_policy_is_driven_in_order():
    policy = WorkloadPolicy(PolicyConfig(2, 2))
    with pytest.raises(ValueError, match="begin"):
        policy.commit()
    policy.begin()
    with pytest.raises(ValueError, match="in progress"):
        policy.begin()
    assert policy.commit().iteration == 1
    with pytest.raises(ValueError, match="already committed"):
        policy.begin(1)


def test_decisions_depend_only_on_the_record():
    """Two survivors holding equal states and the same record, however it is ordered, agree."""
    a, b = _steady_32x8(), _steady_32x8()
    a.begin(2)
    b.begin(2)
    assert a.state == b.state
    da = a.on_failure([0, 5, 28, 30])
    db = b.on_failure(iter({30: None, 5: None, 28: None, 0: None}))
    assert da == db and a.state == b.state
    assert a.commit() == b.commit()


def test_static_functions_are_pure():
    config = PolicyConfig(8, 4)
    state = static.begin_iteration(config, static.initial_layout(config), 1)
    before = state.work.copy()
    static.apply_failure(state, [3])
    assert state.work == before and state.round == 0


# --- simulator and commit-phase failures ------------------------------------------------------


def test_commit_phase_failure_is_handled_at_the_next_reduce():
    config = PolicyConfig(32, 8)
    reports = simulate(config, 3, [parse_failure("1:31@commit")])
    first, second = reports[0].to_json(), reports[1].to_json()
    assert first["live_replicas"] == 31 and not first["boundary"]
    assert first["per_replica"]["31"] == 8 and first["failed"] == {"31": "commit"}
    assert second["boundary"] and second["extra_microbatches"] == 1
    assert "31" not in second["roles"] and "31" not in second["ran"]
    assert second["failed"] == {} and second["failures_handled"] == [31]
    assert second["contributions"] == 256 and second["committed_ids"] == list(range(256))
    assert reports[2].to_json()["grad_accum"] == 9


def test_parse_failure():
    assert parse_failure("3:5") == FailureEvent(3, (5,))
    assert parse_failure("2:0,7@extension") == FailureEvent(2, (0, 7), "extension", 1)
    assert parse_failure("2:1@extension3") == FailureEvent(2, (1,), "extension", 3)
    assert parse_failure("4:1@commit") == FailureEvent(4, (1,), "commit")
    for bad in ("", "3", "a:1", "3:", "3:1@later", "3:1,1", "3:1@commit2", "3:1@extension0"):
        with pytest.raises(ValueError):
            parse_failure(bad)


def test_simulate_is_deterministic():
    failures = [parse_failure(s) for s in ("1:31", "2:0,5@reduce", "2:7@extension", "3:28")]
    runs = [
        [json.dumps(r.to_json()) for r in simulate(PolicyConfig(32, 8), 4, failures)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# --- microbatch calculator ---------------------------------------------------------------------


def test_calculator_answers_from_the_policy():
    policy = WorkloadPolicy(PolicyConfig(32, 8))
    calc = {r: PolicyNumMicroBatchesCalculator(policy, r, micro_batch_size=2) for r in (0, 28, 30)}
    assert calc[0].get() == 8 and calc[28].get() == 8
    assert calc[0].get_current_global_batch_size() == 512
    assert calc[0].get_current_running_global_batch_size() == 512
    assert calc[0].get_micro_batch_size() == 2
    policy.begin(1)
    policy.on_failure([31])
    assert calc[0].get() == 8  # the first pass does not change inside an iteration
    policy.commit()
    calc[0].update(512, consistency_check=True)
    assert (calc[0].get(), calc[28].get(), calc[30].get()) == (9, 4, 4)
    with pytest.raises(ValueError):
        PolicyNumMicroBatchesCalculator(policy, 32, micro_batch_size=2)


def test_calculator_has_megatron_cores_interface():
    module = pytest.importorskip(
        "megatron.core.num_microbatches_calculator", reason="megatron-core is not installed"
    )
    base = module.NumMicroBatchesCalculator
    for name, member in inspect.getmembers(base, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(PolicyNumMicroBatchesCalculator, name, None)
        assert ours is not None, f"missing {name}"
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(member).parameters
        ), name


# --- architecture ------------------------------------------------------------------------------


def test_policy_layer_is_pure_python():
    """Layer 3 imports only the standard library and itself: no torch, MPI or numpy."""
    allowed_prefixes = ("megatron_recover.policy",)
    stdlib = sys.stdlib_module_names
    for path in sorted(POLICY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or name.startswith(allowed_prefixes), f"{path.name}: {name}"
    probe = (
        "import sys, megatron_recover.policy.plan_cli; "
        "print(sorted(m for m in ('torch', 'mpi4py', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        cwd=POLICY_DIR.parents[1],
    )
    assert out.stdout.strip() == "[]"


def _ids(policy, iteration):
    """The ids each live replica contributes in the first pass of `iteration` (then commits)."""
    policy.begin(iteration)
    contributed = {r: sorted(policy.work(r).contributed) for r in policy.layout.replicas}
    policy.commit()
    return contributed


@pytest.mark.parametrize("mode", ["exact", "reserve"])
def test_grow_back_to_w_init_restores_the_launch_layout(mode):
    """Standbys take the dead replicas' ids: once all are back, every replica runs exactly what
    it ran at launch (the ids of slice r are r*G .. r*G+G-1, computed here from B and W)."""
    policy = WorkloadPolicy(PolicyConfig(4, 2, mode=mode))
    policy.begin(1)
    policy.on_failure([1])
    policy.commit()
    assert policy.layout.replicas == (0, 2, 3)
    policy.grow([1])
    assert _ids(policy, 2) == {r: [2 * r, 2 * r + 1] for r in range(4)}


def test_partial_grow_keeps_b():
    """Two lost, one back: three replicas share B = 8 by Algorithm 7 (3, 3, 2)."""
    policy = WorkloadPolicy(PolicyConfig(4, 2))
    policy.drop([1, 3])
    policy.grow([3])
    contributed = _ids(policy, 1)
    assert sorted(k for ids in contributed.values() for k in ids) == list(range(8))
    assert sorted(len(ids) for ids in contributed.values()) == [2, 3, 3]


def test_adaptive_grows_its_batch_back():
    policy = WorkloadPolicy(PolicyConfig(4, 2, policy="adaptive"))
    policy.drop([2])
    assert sum(len(ids) for ids in _ids(policy, 1).values()) == 6
    policy.grow([2])
    assert sorted(k for ids in _ids(policy, 2).values() for k in ids) == list(range(8))


def test_grow_refuses_live_or_unknown_ids_and_mid_iteration():
    policy = WorkloadPolicy(PolicyConfig(4, 2))
    policy.drop([1])
    with pytest.raises(ValueError, match="cannot grow"):
        policy.grow([0])
    with pytest.raises(ValueError, match="cannot grow"):
        policy.grow([4])
    policy.begin(1)
    with pytest.raises(ValueError, match="between iterations"):
        policy.grow([1])

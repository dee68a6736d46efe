"""The simulator's checkpoint-restart accounting, replayed on the CPU benchmark's failures.

`scripts/bench_vs_restart.py` places its failures at iterations (a rank is killed as iteration f
begins), not at wall-clock times, so the benchmark is predicted with the same per-event costs as
`simulator.simulate_restart` (iterations, blocking saves, a stall per failure, the rollback to
the newest checkpoint) on that placement. The one cost this machine adds: each launch's first
save also starts megatron-core's writer helper processes (`writer_startup_s`).
"""


def restart_window_s(*, iteration_s: float, interval: int, train_iters: int,
                     failures: list[int], save_s: float, writer_startup_s: float,
                     failure_cost_s: float, kill_offset_s: float = 0.0) -> float:
    """Seconds from the end of iteration 1 to the first completion of `train_iters`: each
    failure f kills the job as iteration f begins (the first time it is reached), stalls it
    `failure_cost_s` (detection, restart initialization, load), and the relaunch redoes the
    iterations after the newest checkpoint."""
    elapsed, done, pending, first_save = 0.0, 1, list(failures), True
    checkpoint = 0
    while done < train_iters:
        if pending and done + 1 == pending[0]:
            pending.pop(0)
            elapsed += kill_offset_s + failure_cost_s
            done, first_save = checkpoint, True
            continue
        if done == 0:  # a relaunch from scratch redoes iteration 1 too
            elapsed += iteration_s
            done = 1
            continue
        elapsed += iteration_s
        done += 1
        if done % interval == 0 and done < train_iters:
            elapsed += save_s + (writer_startup_s if first_save else 0.0)
            first_save = False
            checkpoint = done
    return elapsed


def predict_ratio(inputs: dict) -> float:
    """Recover's measured per-machine throughput over restart's predicted one at the held-out
    interval (recover does not depend on the interval)."""
    window = restart_window_s(iteration_s=inputs["iteration_s"],
                              interval=inputs["held_out_N"],
                              train_iters=inputs["train_iters"], failures=inputs["failures"],
                              save_s=inputs["save_s"],
                              writer_startup_s=inputs["writer_startup_s"],
                              failure_cost_s=inputs["failure_cost_s"],
                              kill_offset_s=inputs.get("kill_offset_s", 0.0))
    restart_tokens_per_s = inputs["committed_tokens"] / window
    return inputs["recover_tokens_per_s"] / restart_tokens_per_s

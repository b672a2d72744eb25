"""benchmarks.policy_sim: W6's closed loop through the real Scheduler on a simulated clock."""

from __future__ import annotations

from benchmarks import policy_sim


def test_a_small_w6_runs_every_turn_and_the_tier_computes_each_history_once():
    workload = policy_sim.w6(conversations=4)
    runs = {
        (tier, budget): policy_sim.simulate(
            workload, num_gpu_blocks=160, tier_gib=tier, max_num_loaded_blocks=budget
        )
        for tier, budget in ((0.0, 0), (1.0, 0), (1.0, 40))
    }
    for run in runs.values():
        assert run.steps > 6 * 128 and 0 < run.ttft_p50_ms <= run.ttft_p99_ms
        assert len(run.ttft_p50_by_turn_ms) == 6
        # A step starts no earlier than its plan: a turn sent to an idle GPU still waits for its forward.
        assert all(ttft > 0 for ttft in run.ttft_p50_by_turn_ms)
    new_tokens = 4 * 6 * 256  # no cache can avoid the user's own tokens
    no_tier, tier = runs[0.0, 0], runs[1.0, 0]
    assert no_tier.prompt_tokens_computed > 2 * tier.prompt_tokens_computed
    assert new_tokens <= tier.prompt_tokens_computed < 1.5 * new_tokens  # (partial blocks, pre-emptions)


def test_the_replicas_budget_on_the_h200_and_the_h100():
    assert policy_sim.replica_load_budget() == 102
    assert policy_sim.replica_load_budget(*policy_sim.DEVICES["h100"]) == 137  # as its replica logged

"""The cluster-scale what-if (jodc.sim.cluster)."""
import pytest

from jodc.sim import cluster_what_if


def test_cluster_what_if_reports_gain_gap_and_planning_time():
    result = cluster_what_if(16, seqs_per_device=4, minibatches=1)
    assert result.devices == 16 and result.seqs_per_device == 4
    assert result.odc_gain_same_plan >= 1.0  # ODC never waits at per-microbatch barriers
    assert result.odc_gain_over_local_sort >= result.odc_gain_same_plan * 0.99
    assert 1.0 <= result.lb_mini_gap_to_bound < 1.05
    assert result.plan_ms_lb_mini > 0 and result.plan_cpu_ms_lb_mini > 0
    assert result.plan_fraction_of_step == pytest.approx(result.plan_cpu_ms_lb_mini / 1e3 / result.odc_step_time)
    with pytest.raises(ValueError, match="devices"):
        cluster_what_if(0)

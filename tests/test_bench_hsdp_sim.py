"""bench/hsdp_sim.py on two nodes: every layout predicted, crossovers found, the JSON keys the docs quote present."""
import json

from bench import hsdp_sim


def test_two_nodes_small_minibatches(capsys):
    record = hsdp_sim.main(["--devices", "16", "--seqs-per-device", "4", "--minibatches", "1", "--sweep-devices",
                            "16", "--sweep-sizes", "1", "4", "--no-save"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == record
    for setting in ("sft", "rl"):
        assert record[f"sim_{setting}_16_winner"] in {"flat ODC", "HSDP-ODC (8)", "HSDP-collective (8)",
                                                       "flat collective"}
        assert record[f"sim_{setting}_16_hsdp_odc_vs_flat_odc"] > 1  # 400 Gb/s ports: flat ODC pays across nodes
    assert [c["devices"] for c in record["crossovers"]] == [16, 16]
    assert all(c["effective_p2p_GBps"] > 50 for c in record["crossovers"])
    sweep = record["sweeps"][0]["hsdp_odc_vs_best_collective_by_seqs_per_device"]
    assert set(sweep) == {"1", "4"} and sweep["1"] < 1.01  # one sequence per device: nothing to rebalance, parity
    assert "| 16 |" in out

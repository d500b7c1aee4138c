"""bench/losses.py's clocks: CPU time and wall time on the CPU, wall time only on an accelerator (where the process's
CPU time is the dispatching thread, not the work), and the headline ratios taken on the device's clock."""

from bench import losses

TINY = ["--vocab", "256", "--batch", "1", "--seq", "32", "--repeats", "2", "--no-save"]


def test_clocks_for_each_platform():
    assert losses.clocks_for("cpu") == ("cpu", "wall")
    assert losses.clocks_for("gpu") == ("wall",) == losses.clocks_for("tpu")


def test_on_the_cpu_the_headline_ratios_use_cpu_time(monkeypatch, capsys):
    real = losses.time_round_robin

    def known_times(compiled, logits, repeats, **kw):  # real timings taken, then set to known values per clock
        times = real(compiled, logits, repeats, **kw)
        assert set(times) == {"cpu", "wall"} and all(t > 0 for t in times["cpu"]["ppo"] + times["wall"]["ppo"])
        for clock, topk in (("cpu", 3.0), ("wall", 2.0)):
            for name in times[clock]:
                times[clock][name] = [topk if name == "dppo_topk" else 1.0] * repeats
        return times

    monkeypatch.setattr(losses, "time_round_robin", known_times)
    r = losses.main(TINY)
    assert r["time_clock"] == "cpu" and r["cpu_ms"]
    by_vocab = r["by_vocab"]["256"]
    assert by_vocab["dppo_topk_vs_ppo_time"] == 3.0 and by_vocab["dppo_topk_vs_ppo_wall_time"] == 2.0


def test_on_an_accelerator_only_wall_time_is_taken_and_reported(monkeypatch, capsys):
    monkeypatch.setattr(losses, "clocks_for", lambda platform: ("wall",))  # what a GPU's platform gets
    r = losses.main(TINY)
    assert r["time_clock"] == "wall" and r["cpu_ms"] == {}
    assert r["dppo_topk_vs_ppo_time"] == r["dppo_topk_vs_ppo_wall_time"] > 0
    assert r["wall_ms"]["256"]["ppo"] > 0
    table = capsys.readouterr().out
    assert "ppo" in table and "not taken on accelerators" in table

"""jodc's benchmarks: each module measures one thing side by side and reports it through `bench.harness` (a table,
then one JSON line, kept in bench/results/ unless --no-save). Run one from the repository root as
``python -m bench.<name>`` (``--help`` lists its flags)."""

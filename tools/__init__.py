"""The repository's tooling that is not part of the library: mpirun jobs (`mpirun`), HLO checks (`hlo_check`), the
GPU check and its parts (`gpu_check`, `step_runner`, `bounded_pytest`, ...). The scripts run by path
(``python tools/gpu_check.py``) and import each other by name from their folder; the benchmarks import them as
``tools.<name>``, the tests by name (pyproject.toml's pytest pythonpath)."""

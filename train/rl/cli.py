"""`python -m jodc.train.rl.cli --config configs/rl_demo.yaml ...`: the same as `jodc-train rl ...` (train/cli.py)."""
import sys
from typing import Sequence

from ..cli import main as _main


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point of the `rl` command; returns the process exit status."""
    return _main(["rl", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

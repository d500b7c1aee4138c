"""`python -m jodc.train sft --config ...` (same as the jodc-train command)."""
import sys

from .cli import main

sys.exit(main())

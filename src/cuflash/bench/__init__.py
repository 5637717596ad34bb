"""Side-by-side benchmark of cuflash and torch SDPA's backends (see `python -m cuflash.bench -h`)."""
from .harness import PROVIDERS, Case, run_case

__all__ = ["PROVIDERS", "Case", "run_case"]

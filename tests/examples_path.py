"""Importing this puts the repository's examples/ on sys.path, so tests run the examples."""

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

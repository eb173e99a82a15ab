"""``python -m scripts.kafka_local ...``: the command line (cli.py)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())

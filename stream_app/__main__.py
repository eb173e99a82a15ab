"""``python -m stream_app`` is the ``loopwarden`` command."""

from stream_app.cli import main

raise SystemExit(main())

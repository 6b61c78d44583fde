"""``python -m loadtest``."""

from .cli import main

raise SystemExit(main())

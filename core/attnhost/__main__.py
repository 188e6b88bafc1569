"""``python -m attnhost``: the same CLI as the ``attnhost`` console script."""

from attnhost.cli import main

raise SystemExit(main())

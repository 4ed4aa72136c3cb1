"""``python -m cvt_cutlass.cli``: the ``cvt-cutlass`` command."""

from . import main

raise SystemExit(main())

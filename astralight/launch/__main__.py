"""``python -m astralight.launch``: the same as ``astralight run``."""

import sys

from astralight.launch import main

sys.exit(main())

"""``python -m pdctl.scaler``: the scaler daemon on its router host (daemon.py)."""

import sys

from pdctl.scaler.daemon import main

sys.exit(main())

"""`python -m monitoring.receiver`: see `monitoring.receiver.cli`."""
import sys

from monitoring.receiver.cli import main

sys.exit(main())

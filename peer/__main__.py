"""`python -m peer` is the `pathswarm` command."""

import sys

from peer.cli import main

sys.exit(main())

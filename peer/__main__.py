"""`python -m peer` is the `pathswarm` command."""

import sys

from peer.cli.main import main

sys.exit(main())

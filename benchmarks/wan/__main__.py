"""`python -m benchmarks.wan --out DIR`: see benchmarks/wan/__init__.py."""

from benchmarks.wan.driver import main

raise SystemExit(main())

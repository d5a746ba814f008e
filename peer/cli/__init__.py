"""The `pathswarm` command line (`main`), one module per group of subcommands, the demo and the
local swarm launcher that the demo and the tests use.

May import: everything. Command modules import heavy layers inside their handlers, so `--help` and
flag errors stay fast.
"""

"""The maintainers' side: the Prometheus metrics a peer serves (`metrics`, a leaf every layer of the
peer may import), the swarm monitor (`swarm/`: `pathswarm monitor`), and beside them the Prometheus
rules (`prometheus/`) and Grafana dashboards (`grafana/`) that watch both.

`metrics` imports prometheus_client and psutil only; `swarm` reads low layers of `peer` (see its map).
"""

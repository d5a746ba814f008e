"""What maintainers watch: the Prometheus metrics a peer serves (`metrics`).

May import: prometheus_client and psutil only; the peer's layers import this one.
"""

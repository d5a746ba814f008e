"""The swarm monitor (`pathswarm monitor`): a client-mode DHT node that reads a run's signed claims on
an interval and shows the whole swarm as Prometheus metrics and a status page.

`view` is the pure computation (claims -> swarm view), `plan` the scheduler's plan for those claims
(the peers' own planner on their probe records), `exporter` the Prometheus collector, `poller` the
DHT side, `page` and `status` the status page, `service` wires them together. It imports only `dht`,
`monitoring`, `peer.config`, `peer.model.grid`, `peer.run` and, for the plan, `peer.scheduler` and
`peer.swarm.planning`; only `peer.cli` imports it.
"""

#: where the monitor's metrics and status page listen unless --host says otherwise: they show every
#: peer's id, address and state, so this machine only (docs/maintainer.md: how to expose them). Here,
#: not in `service`, so that the command line reads it without loading hivemind.
DEFAULT_HOST = "127.0.0.1"

"""What a peer reports about its training in its claim (`Progress`): the training loop fills it in, the
membership's heartbeat publishes it (peer/swarm/membership.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Progress:
    """What a peer reports about its training in its claim (a claim, to others: see DESIGN §8)."""

    step: int = 0
    outer_round: int = 0
    tokens_total: int = 0
    tokens_per_second: float = 0.0
    digests: dict[str, str] = field(default_factory=dict)
    module_rounds: dict[str, list[int]] = field(default_factory=dict)
    loss: float | None = None
    sync_outcomes: dict[str, int] = field(default_factory=dict)
    bad_parts: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    #: path index -> inner steps trained on it as of the end of round `outer_round` (none of the next),
    #: and of those, the steps of that round itself (`ClaimRecord.round_steps`)
    path_steps: dict[int, int] = field(default_factory=dict)
    round_steps: dict[int, int] = field(default_factory=dict)

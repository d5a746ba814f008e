"""The typed configuration tree: what a run fixes for everyone (`RunManifest`, peer/config/manifest.py)
and what each peer chooses (`PeerConfig`, peer/config/peer_config.py).

Each setting is declared once, there: its type, bounds, default and, in its description, its help.
The `pathswarm peer` flags are `PeerConfig`'s fields; the `pathswarm run create` flags are the
manifest's described fields (peer/run/options.py); both are generated (peer/cli/flags.py).
"""

from peer.config.manifest import (
    MANIFEST_FORMAT_VERSION,
    MAX_ROUTER_FILE_BYTES,
    AdmissionConfig,
    InnerOptimizerConfig,
    OuterOptimizerConfig,
    RunManifest,
    SchedulerConfig,
    SyncConfig,
)
from peer.config.peer_config import ENV_PREFIX, MIN_PIN_HEX, PeerConfig, load_peer_config, one_line

__all__ = [
    "AdmissionConfig",
    "ENV_PREFIX",
    "MANIFEST_FORMAT_VERSION",
    "MAX_ROUTER_FILE_BYTES",
    "MIN_PIN_HEX",
    "InnerOptimizerConfig",
    "OuterOptimizerConfig",
    "PeerConfig",
    "RunManifest",
    "SchedulerConfig",
    "SyncConfig",
    "load_peer_config",
    "one_line",
]

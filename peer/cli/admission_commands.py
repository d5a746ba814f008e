"""`pathswarm run invite` and `pathswarm run admit`: how a run's creator lets volunteers in.

`invite` writes N fresh invite codes, keeping only their sha256 beside the manifest
(`RUN.invites.json`, read by the creator's bootstrap node, which redeems them), and prints the codes
to hand out: a volunteer passes one with `--invite CODE` and its peer is admitted at start. `admit`
signs an admission for a peer id the volunteer sent (its peer logs it at start: "joined run … as
Qm…"), offline, for `--admission TOKEN`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peer.errors import ConfigError


def add(rsub) -> None:
    i = rsub.add_parser("invite", help="write invite codes for volunteers (kept hashed beside the manifest)")
    i.add_argument("--manifest_path", type=Path, required=True, help="the run's signed manifest")
    i.add_argument("--count", type=int, default=1, help="how many codes (default: 1)")
    a = rsub.add_parser("admit", help="sign a volunteer's admission to the run for its peer id")
    a.add_argument("--manifest_path", type=Path, required=True, help="the run's signed manifest")
    a.add_argument("--identity_path", type=Path, required=True, help="the key that created the run")
    a.add_argument("--peer_id", required=True, help="the volunteer's peer id (Qm…, its peer logs it)")


def cmd_invite(args: argparse.Namespace) -> int:
    from peer.run.record import load_verified_manifest
    from peer.swarm.authority import (
        code_digest,
        invites_locked,
        invites_path,
        new_invite_code,
        read_invites,
        write_invites,
    )

    if not 1 <= args.count <= 10_000:
        raise ConfigError("--count must be between 1 and 10000")
    manifest, _ = load_verified_manifest(args.manifest_path)
    path = invites_path(args.manifest_path)
    codes = [new_invite_code() for _ in range(args.count)]
    with invites_locked(path):  # the run's authority may be redeeming codes from the same file
        try:
            invites = read_invites(path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        invites.update({code_digest(c): {"peer_id": None, "used_at": None} for c in codes})
        write_invites(path, invites)
    print("\n".join(codes))
    note = "" if manifest.admission.mode == "invite" else " (this run is open: codes only skip probation)"
    print(f"{len(codes)} invite code(s) for run {manifest.name} kept hashed in {path}{note}", flush=True)
    return 0


def cmd_admit(args: argparse.Namespace) -> int:
    import base58

    from dht.identity import load_identity
    from peer.run.admission import sign_admission
    from peer.run.record import load_verified_manifest

    manifest, record = load_verified_manifest(args.manifest_path)
    if not args.identity_path.is_file():
        raise ConfigError(f"--identity_path {args.identity_path} does not exist")
    key, _ = load_identity(args.identity_path)
    if key.get_public_key().to_bytes() != record.creator_public_key:
        raise ConfigError(f"--identity_path is not the key that created run {manifest.name}")
    try:
        raw = base58.b58decode(args.peer_id)
    except ValueError:
        raw = b""
    if len(raw) != 34 or raw[:2] != bytes([0x12, 0x20]):
        raise ConfigError(f"--peer_id {args.peer_id!r} is not a peer id (Qm… as a peer logs it at start)")
    print(sign_admission(key, record.run_id, args.peer_id, "invite"), flush=True)
    return 0

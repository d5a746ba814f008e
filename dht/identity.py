"""A peer's identity: one RSA key that is both its libp2p peer id and the key signing its records.

`load_identity` reads (or creates, mode 0400) the key file hivemind's p2p daemon reads; a peer with
no `--identity_path` gets a fresh key in a private temporary file, so that even then the daemon's
peer id and the record-signing key are the same key. That file is deleted as soon as a daemon has
read it (`forget_ephemeral_identity`, called by `dht.node.start_dht`), not only at exit: a peer that
is killed runs no exit handler and would leave its private key in the temporary folder.
`peer_id_of_owner` derives the libp2p peer id from the public key in a record's owner subkey: the
validators tie every record's `peer_id` to the key that signed it, so nobody can publish a claim
that speaks for another peer.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path

import base58
import msgpack
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from dht.errors import SwarmError

logger = logging.getLogger(__name__)

_SHA256_MULTIHASH = bytes([0x12, 0x20])  # multihash code sha2-256, 32-byte digest

#: key files `load_identity` made for a peer without --identity_path, until a daemon has read them
_EPHEMERAL: set[Path] = set()


def load_identity(identity_path: str | os.PathLike | None) -> tuple[RSAPrivateKey, Path]:
    """The peer's RSA key and the file the p2p daemon reads it from."""
    if identity_path is None:
        fd, name = tempfile.mkstemp(prefix="pathswarm-identity-")
        os.close(fd)
        os.unlink(name)  # generate_identity writes it afresh, mode 0400
        P2P.generate_identity(name)
        atexit.register(lambda: Path(name).unlink(missing_ok=True))
        path = Path(name)
        _EPHEMERAL.add(path)
    else:
        path = Path(identity_path)
        if not path.exists():
            if not path.parent.is_dir():
                raise SwarmError(f"cannot create identity {path}: folder {path.parent} does not exist")
            P2P.generate_identity(str(path))
            logger.info(f"created a new identity in {path}")
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = serialization.load_der_private_key(proto.data, password=None)
    except Exception as e:
        raise SwarmError(f"cannot read identity file {path}: {e}") from e
    return key, path


def forget_ephemeral_identity(path: str | os.PathLike) -> None:
    """Deletes a key file `load_identity` made up (a user's --identity_path is never touched): the
    daemon that read it keeps the key, and the caller keeps it in memory."""
    path = Path(path)
    if path in _EPHEMERAL:
        _EPHEMERAL.discard(path)
        path.unlink(missing_ok=True)


def peer_id_of_owner(ssh_public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH form (as owner subkeys hold it)."""
    public = serialization.load_ssh_public_key(ssh_public_key)
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return base58.b58encode(_SHA256_MULTIHASH + hashlib.sha256(encoded).digest()).decode()


def peer_id_of_key(key: RSAPrivateKey) -> str:
    return peer_id_of_owner(key.get_public_key().to_bytes())


_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


@functools.lru_cache(maxsize=4096)
def owner_peer_id(subkey: bytes) -> str | None:
    """The peer id whose key owns a record's subkey (`[owner:ssh-rsa ...]`), or None."""
    match = _OWNER_RE.search(subkey) if isinstance(subkey, bytes) else None
    try:
        return peer_id_of_owner(match.group(1)) if match else None
    except ValueError:
        return None


def canonical_bytes(value) -> bytes:
    """msgpack of `value` with dict keys sorted at every level: the same bytes for the same signed
    record (a report, a contribution) on every peer that signs or checks it."""

    def sort(v):
        if isinstance(v, dict):
            return {k: sort(v[k]) for k in sorted(v)}
        if isinstance(v, list):
            return [sort(x) for x in v]
        return v

    return msgpack.packb(sort(value), use_bin_type=True)


@functools.lru_cache(maxsize=4096)
def signer_of(ssh_public_key: str) -> tuple[str | None, RSAPublicKey | None]:
    """(peer id, key) of an RSA public key in OpenSSH form, carried in a signed record; (None, None)
    if it is not one."""
    try:
        return peer_id_of_owner(ssh_public_key.encode()), RSAPublicKey.from_bytes(ssh_public_key.encode())
    except Exception:  # not an RSA key in OpenSSH form
        return None, None

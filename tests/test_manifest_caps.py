"""A manifest no peer could run is refused in one line naming the field and the cap, when it is read and
before anything is allocated: a grid of too many paths (at `run create`, in a signed file, from the
DHT), and artifacts larger than the disk of the peer that would fetch them."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from dht.schema import ManifestRecord
from peer.artifacts.ref import ArtifactRef
from peer.artifacts.room import check_room, free_bytes
from peer.artifacts.store import ArtifactError, ArtifactStore
from peer.cli.main import main
from peer.config import RunManifest, one_line
from peer.config.manifest import MAX_ROUTING_INDEX_BYTES
from peer.errors import ConfigError
from peer.model.grid import MAX_PATHS, ModelConfig
from peer.run.record import load_verified_manifest, verify_record


def signed(manifest_json: str, key: RSAPrivateKey | None = None) -> ManifestRecord:
    """A record exactly as a creator who edited the manifest by hand would sign it."""
    key = key or RSAPrivateKey()
    run_id = hashlib.sha256(manifest_json.encode()).hexdigest()
    return ManifestRecord(
        run_id=run_id,
        manifest_json=manifest_json,
        creator_public_key=key.get_public_key().to_bytes(),
        signature=key.sign(run_id.encode()),
    )


def with_grid(levels: int, k: int, **model) -> str:
    """A canonical manifest whose model is an LxK grid, whatever the caps say."""
    data = RunManifest(name="huge").model_dump(mode="json")
    data["model"].update(n_levels=levels, modules_per_level=k, **model)
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize(
    "levels,k,model,fragment",
    [
        (8, 64, {}, f"64**8 = 281474976710656 paths exceeds the cap of {MAX_PATHS} paths"),
        (3, 17, {}, f"17**3 = 4913 paths exceeds the cap of {MAX_PATHS} paths"),
        (9, 2, {}, "model.n_levels: Input should be less than or equal to 8"),
        (2, 65, {}, "model.modules_per_level: Input should be less than or equal to 64"),
        # the memory check walks every block of a path: 10**9 of them would take days
        (2, 2, {"blocks_per_module": 10**9}, "= 2000000000 blocks per path exceeds the cap of 256"),
        (2, 2, {"private_blocks_per_path": 255}, "2 * 1 + 255 = 257 blocks per path exceeds the cap of 256"),
    ],
)
def test_a_signed_manifest_over_the_grid_caps_is_refused_in_one_line_before_any_path_is_enumerated(
    tmp_path, levels, k, model, fragment
):
    record = signed(with_grid(levels, k, **model))
    path = tmp_path / "manifest.json"
    path.write_text(record.model_dump_json())
    started = time.monotonic()
    # as a peer, a bootstrap node or an offline command reads a manifest file
    with pytest.raises(ConfigError) as err:
        load_verified_manifest(path)
    # as the peers and the monitor read it from the DHT
    with pytest.raises(ValueError) as from_dht:
        verify_record(record)
    assert time.monotonic() - started < 5  # no walk over 64**8 paths
    for message in (str(err.value), str(from_dht.value)):
        assert "\n" not in message and fragment in message and "model" in message, message


def test_the_largest_grids_under_the_caps_are_accepted():
    for levels, k in ((1, 64), (2, 64), (3, 16), (6, 4), (8, 2)):
        assert ModelConfig(n_levels=levels, modules_per_level=k).n_paths <= MAX_PATHS
    with pytest.raises(ValidationError) as err:
        ModelConfig(n_levels=7, modules_per_level=4)  # 16384 paths
    assert one_line(err.value) == (
        f"modules_per_level ** n_levels = 4**7 = 16384 paths exceeds the cap of {MAX_PATHS} paths"
    )


@pytest.mark.timeout(60)
def test_run_create_refuses_a_grid_over_the_caps_naming_the_flag_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run" / "manifest.json"
    started = time.monotonic()
    code = main(["run", "create", "--name", "huge", "--grid", "8x64", "--out", str(out), "--no_publish"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - started < 30
    assert err.count("\n") == 0 and err.startswith("pathswarm run: error: --grid 8x64: "), err
    assert f"exceeds the cap of {MAX_PATHS} paths" in err, err
    assert not (tmp_path / "run").exists()


def ref(i: int, size: int) -> ArtifactRef:
    digest = hashlib.sha256(str(i).encode()).hexdigest()
    return ArtifactRef(
        name=f"shard-{i}", sha256=digest, size_bytes=size, chunk_bytes=2 << 20, chunks_sha256=digest
    )


def test_artifacts_larger_than_the_free_disk_are_refused_in_one_line_before_a_folder_is_made(tmp_path):
    store = ArtifactStore(tmp_path / "ckpt" / "artifacts")
    free = free_bytes(store.root)
    size = 64 << 30  # the largest artifact a reference may name
    shards = [("dataset.shards", ref(i, size)) for i in range(free // size + 2)]
    with pytest.raises(ArtifactError) as err:
        check_room(store, [("base_checkpoint", ref(-1, 1 << 20)), *shards])
    message = str(err.value)
    assert "\n" not in message and "(base_checkpoint, dataset.shards)" in message, message
    assert "--artifacts_dir" in message and str(store.root) in message
    assert not (tmp_path / "ckpt").exists()


def test_artifacts_that_fit_or_are_already_held_pass_the_room_check(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    held = tmp_path / "held.bin"
    held.write_bytes(b"x" * 5000)
    got = store.add_file(held, "held.bin")
    assert check_room(store, [("router_file", got)]) == 0
    # one file named twice is fetched once; what is held is not fetched at all
    small = ref(1, 1 << 20)
    named = [("router_file", got), ("dataset.shards", small), ("dataset.shards", small)]
    assert check_room(store, named) == 1 << 20


def test_a_routing_index_over_its_cap_is_refused_in_one_line_naming_the_field():
    with pytest.raises(ValidationError) as err:
        RunManifest(name="indexed", routing_index=ref(0, MAX_ROUTING_INDEX_BYTES + 1))
    message, cap = one_line(err.value), MAX_ROUTING_INDEX_BYTES
    assert f"routing_index of {cap + 1} bytes exceeds {cap}" in message, message
    assert RunManifest(name="indexed", routing_index=ref(0, cap)).routing_index is not None

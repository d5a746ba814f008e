"""The WAN lab tells whether a run's peers ended with the same global copies (benchmarks/wan/copies.py):
peer 0's copy is the one evaluated, and a last round that split the holders has no round to repair it."""

from __future__ import annotations

import torch

from benchmarks.wan import report
from benchmarks.wan.copies import copy_groups, global_copy_digest
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from tests.test_wan_report import run

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=2)


def checkpoint_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A peer checkpoint's tensors as the lab loads them: its local model and each module's global copy."""
    model = PathModel(CFG, (0, 0), seed=seed)
    tensors = {f"local/{k}": v.clone() for k, v in model.state_dict().items()}
    for mid, part in model.parts.items():
        tensors.update({f"{mid}/global/{k}": v.clone() for k, v in part.state_dict().items()})
    return tensors


def test_peers_are_grouped_by_the_bits_of_their_global_copies_not_their_local_models():
    a = checkpoint_tensors()
    same = {k: v.clone() for k, v in a.items()}
    same[next(k for k in same if k.startswith("local/"))] += 1.0  # local models differ: that is training
    other = {k: v.clone() for k, v in a.items()}
    name = next(k for k in other if "/global/" in k)
    other[name].view(-1)[0] = torch.nextafter(other[name].view(-1)[0], torch.tensor(1e9))  # one ulp apart
    digests = [global_copy_digest(t) for t in (a, other, same, other)]
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    assert copy_groups(digests) == [[0, 2], [1, 3]]
    assert copy_groups([global_copy_digest(a)] * 4) == [[0, 1, 2, 3]]
    no_sync = {k: v for k, v in a.items() if k.startswith("local/")}
    assert global_copy_digest(no_sync) is None and copy_groups([None] * 4) == []


def test_a_run_whose_peers_ended_split_says_so_under_the_table_with_each_copys_loss(tmp_path):
    none = dict(mean=0.0, max=0.0, syncs=4, measured=False)
    runs = {
        "diloco_fp32": run(
            28e6, 26e6, none, final_copy_groups=[[0, 2], [1, 3]], eval_loss_per_copy=[2.2583, 2.1507]
        ),
        "streaming_sparse": run(0.5e6, 0.3e6, none, final_copy_groups=[[0, 1, 2, 3]]),
        "no_sync": run(0.0, None, none, final_copy_groups=[]),
    }
    summary = dict(peers=4, cap_mbit=20.0, loss=0.0, steps=192, H=24, fragments=4, overlap_steps=5,
                   mixing_alpha=0.5, codec="nf4", compute_cores=0.25, model_parameters=3.2e6,
                   model_bytes_fp32=12.8e6, runs=runs, failed={}, targets={})  # fmt: skip
    text = report.write_markdown(tmp_path / "wan.md", summary)
    split = [line for line in text.splitlines() if "different global copies" in line]
    assert split == [
        "diloco_fp32: the peers ended with 2 different global copies (peers 0, 2; peers 1, 3); eval loss "
        "of each: 2.2583, 2.1507; the table's is peer 0's"
    ], text

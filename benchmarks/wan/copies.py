"""Whether a run's peers ended with the same global copies. The lab evaluates peer 0's copy, which
speaks for the run only where every holder holds the same bits: a run's last round can split them
(members that decide on different sets of reports by their deadlines), and no later round repairs
it. A split is reported beside the table, with the eval loss of each copy."""

from __future__ import annotations

import hashlib

import torch


def global_copy_digest(tensors: dict[str, torch.Tensor]) -> str | None:
    """SHA-256 of a checkpoint's global copies (names and bits), None where it keeps none (no_sync)."""
    names = sorted(k for k in tensors if "/global/" in k)
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode())
        # its own memory, as bytes whatever the dtype (bf16 has no numpy type), hashed without a copy
        # (as `peer.sync.module_sync.state_digest` does)
        digest.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def copy_groups(digests: list[str | None]) -> list[list[int]]:
    """Peers, by index, grouped by the global copy they ended with, in order of first appearance;
    [] where no peer keeps one."""
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(digests):
        if d is not None:
            groups.setdefault(d, []).append(i)
    return list(groups.values())


def split_lines(runs: dict[str, dict]) -> list[str]:
    """A line for each run whose peers ended with different global copies."""
    lines = []
    for name, r in runs.items():
        groups = r.get("final_copy_groups") or []
        if len(groups) < 2:
            continue
        held = "; ".join("peers " + ", ".join(str(i) for i in g) for g in groups)
        losses = r.get("eval_loss_per_copy") or []
        each = ", ".join(f"{v:.4f}" for v in losses)
        lines.append(
            f"{name}: the peers ended with {len(groups)} different global copies ({held}); eval loss of "
            f"each: {each or 'not measured'}; the table's is peer 0's"
        )
    return lines

"""How much memory training one path of a run needs, known from the manifest before anything is allocated.

A peer holds, per parameter of its path: the local fp32 weights, their gradients, AdamW's two moments,
the global copy θ̄ and the outer momentum of DiLoCo, and the outer gradient in flight during a sync
(`STATE_BYTES_PER_PARAMETER`). Activations grow with the batch: per sample and token, each block keeps
its inputs, attention and MLP intermediates for the backward pass, attention scores grow with the
sequence length squared, and the LM head keeps logits and their gradient. The estimate is deliberately
a little high (`SAFETY_FACTOR`): a peer that starts and then dies of out-of-memory mid-round costs the
swarm more than one that is told at once which `--batch_size` fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from peer.config import RunManifest
from peer.errors import ConfigError
from peer.model.grid import Path, all_paths, path_module_ids

#: local weights 4 + gradients 4 + AdamW moments 8 + global copy 4 + outer momentum 4 + outer gradient 4
#: + a received copy during aggregation 4 (fp32 bytes each)
STATE_BYTES_PER_PARAMETER = 32
FLOAT_BYTES = 4
SAFETY_FACTOR = 1.25


@dataclass(frozen=True)
class MemoryEstimate:
    """A path's memory: fixed state per parameter, plus activations that grow with the batch."""

    parameters: int
    state_bytes: int
    bytes_per_sample: int

    def total_bytes(self, batch_size: int) -> int:
        return int(SAFETY_FACTOR * (self.state_bytes + batch_size * self.bytes_per_sample))

    def largest_batch(self, available_bytes: int) -> int:
        room = available_bytes / SAFETY_FACTOR - self.state_bytes
        return max(0, int(room // self.bytes_per_sample))


def path_parameters(manifest: RunManifest, path: Path) -> int:
    from peer.model.transformer import parameter_map  # torch, on the meta device: nothing allocated

    slots = parameter_map(manifest.model, 1, path_module_ids(manifest.model, path))
    total = 0
    for slot in slots:
        n = 1
        for dim in slot.shape:
            n *= dim
        total += n
    return total


def estimate_path_memory(manifest: RunManifest, path: Path | None = None) -> MemoryEstimate:
    """One path's needs (every path of a grid has the same shape; the first is measured by default)."""
    m, t = manifest.model, manifest.seq_len + 1
    parameters = path_parameters(manifest, path if path is not None else all_paths(m)[0])
    per_block = t * (8 * m.d_model + 2 * m.d_ff) + 2 * m.n_heads * t * t  # activations + scores
    per_sample = FLOAT_BYTES * (m.blocks_per_path * per_block + 3 * t * m.vocab_size + 2 * t * m.d_model)
    return MemoryEstimate(parameters, STATE_BYTES_PER_PARAMETER * parameters, per_sample)


def available_bytes(device_type: str, device_index: int | None = None) -> int:
    """Free memory of the device a path would train on: accelerator memory, or RAM for the CPU."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device_index or 0)[0])
    return int(psutil.virtual_memory().available)


def check_path_fits(
    manifest: RunManifest,
    batch_size: int,
    device_type: str,
    available: int,
    cpu_available: int | None = None,
) -> MemoryEstimate:
    """Raises ConfigError, saying which --batch_size or --device would fit, when the path does not."""
    estimate = estimate_path_memory(manifest)
    need = estimate.total_bytes(batch_size)
    if need <= available:
        return estimate
    what = "GPU memory" if device_type == "cuda" else "memory"
    head = (
        f"not enough {what} for a path of run {manifest.name}: batch size {batch_size} needs about "
        f"{_gib(need)} ({estimate.parameters:,} parameters), {_gib(available)} is available"
    )
    fits = estimate.largest_batch(available)
    options = []
    if fits >= 1:
        options.append(f"--batch_size {fits} would fit")
    if device_type == "cuda" and cpu_available is not None and need <= cpu_available:
        options.append("--device cpu would fit (slower)")
    if not options:
        options.append(
            f"even --batch_size 1 needs {_gib(estimate.total_bytes(1))}: use a machine with more memory"
            + (" or --device cpu" if device_type == "cuda" else "")
        )
    raise ConfigError(f"{head}: {'; '.join(options)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"

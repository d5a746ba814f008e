"""Research tools that need no swarm: DiPaCo in one process (`simulate`), experiments over it
(`experiment`), evaluation as the paper does it (`evaluation`), the grid from peers' checkpoints
(`grid_checkpoints`), single-path generation and export (`inference`), the same path as a Hugging
Face GPT-2 folder (`hf_export`).

May import: every layer up to `peer.training` (for the shared inner step); not `peer.cli`.
"""

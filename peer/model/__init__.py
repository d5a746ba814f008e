"""The DiPaCo model: the grid's shape (`grid`, no torch), the transformer modules and paths
(`transformer`), tokenizers (`tokenizer`), the router (`router`) and routing documents to paths
(`route`).

May import: the leaves (`peer.errors`, `peer.seeding`).
"""

"""The settings of `pathswarm run create`, each declared once.

A `run create` flag is either a choice about how the run is made (`RunChoices`: the model's size,
the base model, sharing the data) or a setting of the manifest itself: every field of `RunManifest`,
or of one of its sections, that has a description (peer/config/manifest.py). A manifest setting's
flag is named after its field, or after the field's `flag` where two sections would share a name
(`outer.lr` is `--outer_lr`). `RunOptions` holds both, flat, by flag name; `manifest_settings` puts
the manifest's back into their sections. A section added to the manifest with described fields
gets its flags without more code.
"""

from __future__ import annotations

from copy import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

from peer.config import RunManifest
from peer.model.grid import PRESETS

#: manifest sections `run create` fills itself: the model's shape comes from --preset and --grid
COMPUTED_SECTIONS = ("model",)


class RunChoices(BaseModel):
    """How a run is made, beyond the settings its manifest records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str = Field("tiny", description=f"model size preset ({', '.join(PRESETS)})")
    grid: str = Field("2x2", description="LxK: levels x modules per level")
    private_blocks: int = Field(0, ge=0, description="blocks per path kept private after the grid")
    blocks_per_module: int | None = Field(
        None, ge=1, description="override the preset's blocks per module; unset: the preset's"
    )
    warm_start_steps: int = Field(
        0,
        ge=0,
        description="train a dense base model of one path's size this many steps on the run's data; "
        "every module starts from it and the router uses its features (DiPaCo's warm start)",
    )
    warm_start_batch_size: int = Field(16, ge=1, description="batch size of the base model's training")
    base_checkpoint: str | None = Field(
        None,
        description="start every module from this base model instead (a safetensors file a run create "
        "wrote); unset: from scratch, or the --warm_start_steps one",
    )
    share_data: bool = Field(
        False,
        description="copy the --data_files beside the manifest, named by hash: nodes started with this "
        "--manifest_path serve them and peers fetch them (no volunteer needs a copy or --data_root)",
    )
    routing_index_documents: int = Field(
        100_000,
        ge=0,
        description="route this many of the corpus's first documents here, once, into the run's routing "
        "index (served beside the manifest): peers read where each goes instead of routing it "
        "themselves; 0: none (a hub dataset is never indexed)",
    )


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def manifest_flags(manifest: type[BaseModel] = RunManifest) -> dict[str, tuple[tuple[str, ...], FieldInfo]]:
    """Flag name -> (where in the manifest, the field) for every described field of `manifest` and
    of its sections, in declaration order. Two fields that would make the same flag are a bug."""
    found: dict[str, tuple[tuple[str, ...], FieldInfo]] = {}

    def add(where: tuple[str, ...], field: FieldInfo) -> None:
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        name = str(extra.get("flag", where[-1]))
        if name in found:
            raise TypeError(f"--{name} would set both {'.'.join(found[name][0])} and {'.'.join(where)}")
        found[name] = (where, field)

    for name, field in manifest.model_fields.items():
        section = _section(field.annotation)
        if section is not None and name not in COMPUTED_SECTIONS:
            for sub, sub_field in section.model_fields.items():
                if sub_field.description:
                    add((name, sub), sub_field)
        elif section is None and field.description:
            add((name,), field)
    return found


MANIFEST_FLAGS = manifest_flags()


def _run_options() -> type[RunChoices]:
    clash = set(MANIFEST_FLAGS) & set(RunChoices.model_fields)
    if clash:
        raise TypeError(f"run create flags declared both in the manifest and in RunChoices: {sorted(clash)}")
    fields: dict[str, Any] = {name: (f.annotation, copy(f)) for name, (_, f) in MANIFEST_FLAGS.items()}
    return create_model(
        "RunOptions",
        __base__=RunChoices,
        __module__=__name__,
        __doc__="The choices behind a new run, named as `pathswarm run create`'s flags: `RunChoices` "
        "and the manifest's described settings (`MANIFEST_FLAGS`), flat.",
        **fields,
    )


RunOptions = _run_options()


def manifest_settings(options: RunChoices) -> dict[str, Any]:
    """The manifest settings in `options`, nested as in the manifest: {"seed": 0, "sync": {...}, …}."""
    settings: dict[str, Any] = {}
    for flag, (where, _) in MANIFEST_FLAGS.items():
        value = getattr(options, flag)
        if len(where) == 1:
            settings[where[0]] = value
        else:
            settings.setdefault(where[0], {})[where[1]] = value
    return settings

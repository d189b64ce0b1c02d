"""The base of every config section: strict, documented, validated on construction.

Unknown keys are errors (``extra="forbid"``) so a typo never silently falls back to a default, and
each field's docstring (the string literal under it) becomes its description.
A tagged-union field given without ``type`` keeps its default's type, so
``--rollout.engine.max_num_seqs 8`` tunes the default engine instead of failing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    """A config section: unknown keys rejected, values validated on assignment too."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _default_union_tags(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            value = data.get(name)
            if field.discriminator == "type" and isinstance(value, dict) and "type" not in value:
                default = field.get_default(call_default_factory=True)
                data = {**data, name: {"type": default.type, **value}}
        return data

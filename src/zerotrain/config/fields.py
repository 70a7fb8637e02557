"""The base every config section derives from and the field types they share.

One place decides how strict a section is (``_Section``) and what an element count or a
size may be, so every section of the schema applies the same rules.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

PrecisionName = Literal["fp32", "bf16", "fp16"]


def _whole_number(value: Any) -> Any:
    """Turn 5e8-style floats into ints: DeepSpeed configs routinely write element counts so."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(_whole_number), Field(ge=0)]
Size = Annotated[int, BeforeValidator(_whole_number), Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


class _Section(BaseModel):
    """Base of every section: strict types (no "2" -> 2, no true -> 1; 1/0 for a boolean is
    read as DeepSpeed reads it), no unknown keys,
    finite floats, and immutable so every component sees the values that were validated."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _one_and_zero_as_bool(cls, value: Any, info: ValidationInfo) -> Any:
        """``1``/``0`` for a boolean key read as true/false, as DeepSpeed reads them (configs
        written for it use them); any other number, or a string, stays an error."""
        field = cls.model_fields.get(info.field_name or "")
        if (field is not None and field.annotation in (bool, Optional[bool])
                and type(value) is int and value in (0, 1)):
            return bool(value)
        return value

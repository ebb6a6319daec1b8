"""The base class of every settings section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A settings section: unknown keys are errors, so a misspelled setting is never ignored;
    NaN and infinite numbers are errors too (`lr = inf` would train nothing but NaNs)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

"""Where transformers' API differs between the pinned release and the newest, in one place.

The tests run on both (``python3 dev.py check --newest``). Each name here says which
releases it describes; a test calls these instead of spelling either form itself.
"""

from __future__ import annotations

from typing import Any


def cache_keyword() -> str:
    """The keyword a model's ``forward`` takes its cache under.

    ``past_key_values`` up to transformers 5.23; from 5.24 it is ``cache`` (the old name
    still works there, with a FutureWarning: "will be removed in version 5.40.0"), and
    the outputs carry ``.cache`` (``.past_key_values`` warns the same way).
    """
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """``{cache_keyword(): cache}``: the keyword argument that hands ``cache`` to a model."""
    return {cache_keyword(): cache}


def returned_cache(output: Any) -> Any:
    """The cache a model's output carries, under the name this release gives it."""
    return getattr(output, cache_keyword())

"""The sampling fields of /v1/chat/completions' body, reused by request models of other routes (same schema)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, create_model

from .openai_protocol import _SamplingRequest
from .protocol_fields import _Strict


def model_with_sampling_fields(name: str, names: tuple[str, ...], doc: str, base: type[BaseModel] = _Strict
                               ) -> type[BaseModel]:
    """A strict pydantic base model (`base`: a nested object's, or _Body for a request body) holding `names`, each
    declared exactly as on _SamplingRequest (type, default, schema bounds, validators), so a route that takes them
    documents and checks them as chat does."""
    fields = _SamplingRequest.model_fields
    definitions: dict[str, Any] = {n: (fields[n].annotation, fields[n]) for n in names}
    model = create_model(name, __base__=base, **definitions)
    model.__doc__ = doc
    return model

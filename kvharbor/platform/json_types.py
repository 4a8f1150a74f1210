"""How every route's request models read a JSON body."""

from __future__ import annotations

from pydantic import ConfigDict

REQUEST_FIELDS = ConfigDict(extra="forbid", strict=True)
"""A request model's config: a field the model does not have is a 400 naming it, and a value
of the wrong JSON type is a 400 naming its field. Pydantic's default (lax) mode would read
``"5"`` as 5, ``1.0`` as 1, and ``0``, ``"no"`` or ``0.0`` as false, and answer as if the client
had sent those values; the OpenAPI schema declares the types, OpenAI's API refuses the rest, and
so does kvharbor. (An integer is still taken where a number is declared.)"""

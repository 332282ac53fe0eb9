"""The one exception hierarchy (defined in ``prme.schemas.errors``, whose ``__all__`` names
every class of it)."""

from prme.schemas.errors import *  # noqa: F403
from prme.schemas.errors import __all__ as __all__

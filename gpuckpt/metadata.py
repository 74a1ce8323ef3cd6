"""The metadata model under its public name: ``from gpuckpt.metadata import Metadata`` (the
classes are defined in :mod:`gpuckpt.format.metadata`, with the rest of the format)."""

from gpuckpt.format.metadata import *  # noqa: F403
from gpuckpt.format.metadata import __all__ as __all__

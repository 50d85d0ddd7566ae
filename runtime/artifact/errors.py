"""The base of every user-facing error, and the format's own errors.

Every error raised to a user derives from HloserveError; the CLI prints its message as one line and
exits non-zero (tracebacks only with --debug), and the server turns it into a 4xx in the API's format.
"""
from __future__ import annotations


class HloserveError(Exception):
    """Base class: the message is complete and user-facing."""


class ArtifactError(HloserveError):
    """An artifact directory is missing, corrupted, or of an unknown version."""


class ShapeConstraintError(HloserveError, ValueError):
    """Call-time shapes break the symbolic constraints recorded at export."""

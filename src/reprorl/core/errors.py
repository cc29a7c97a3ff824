"""The pipeline's refusals: each says what is wrong and what to do, in one message.

The command line prints a `ReproError` as one line and exits with 2; every other exception is a
bug and keeps its traceback. The GRPO engine (`reprorl.grpo`) raises the ordinary Python
exceptions a TRL user expects instead.
"""

from __future__ import annotations


class ReproError(RuntimeError):
    """A refusal with one clear message: what is wrong and what to do about it."""


class ConfigError(ReproError):
    """The configuration does not fit the schema."""


class PreservedArtifactError(ReproError):
    """A stage was asked to overwrite an artifact that must be preserved."""


class HeldOutError(ReproError):
    """A stage asked for a corpus file its kind of stage must not see."""


class ModelDirectoryError(ReproError):
    """The base model directory is missing or is not the architecture the profile expects."""


class AuditError(ReproError):
    """A file no longer has the sha256 its manifest recorded."""


class Preempted(ReproError):
    """A signal asked a training stage to stop, and its checkpoint is written (`preempt.py`);
    the command exits with 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.status = 128 + signum

"""The exceptions actorflow raises, one per kind of mistake, so callers can catch precisely."""


class ActorflowError(Exception):
    """Base class of every error actorflow raises on its own account."""


class ConfigError(ActorflowError, ValueError):
    """A training config is malformed; str() is one line naming the YAML path."""


class CheckpointError(ActorflowError, ValueError):
    """A checkpoint can't be resumed from: missing, partial, corrupt, or written by another
    model, layout or data; str() is one line naming the checkpoint's folder."""


class GraphError(ActorflowError, ValueError):
    """A graph was built wrong: shapes, dtypes, devices or names that don't fit."""


class CompileError(ActorflowError):
    """The compiler could not turn a graph into a runnable Plan."""


class DeadlockError(CompileError):
    """The Plan's wait-for graph has a cycle: running it could hang."""


class PlanSerializationError(ActorflowError, ValueError):
    """A Plan could not be written to bytes or read back."""


class FeedError(ActorflowError, ValueError):
    """The feeds given to a run don't match the Plan's placeholders."""


class StallError(ActorflowError, RuntimeError):
    """No actor made progress for the stall timeout."""


class RankError(ActorflowError, RuntimeError):
    """Another rank of the run failed or was lost, so this one stopped too: the message
    names the rank and, for a failure, the actor, stream and iteration where it started."""


class RankLost(RankError):
    """A rank the run may go on without (a parameter server's worker) was lost: ``rank``
    names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class ProtocolError(ActorflowError, RuntimeError):
    """A runtime broke the actor protocol (a second free, a take before an actor can act):
    a bug in the runtime, not in the user's graph. The message names the actor and register."""


class KernelError(ActorflowError, ValueError):
    """A user kernel broke its contract: it wrote into an input (``input``: which one,
    where known) or returned something else than the graph declared."""

    def __init__(self, message: str, input: int | None = None) -> None:
        super().__init__(message)
        self.input = input


class DeviceError(ActorflowError, RuntimeError):
    """A device the plan names can't be used here: a ``cuda:`` device without CuPy or
    without a GPU (the message says which, and the extra that installs CuPy)."""

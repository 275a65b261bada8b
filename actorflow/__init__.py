"""actorflow: an actor-model dataflow runtime in the OneFlow style.

Build a graph of ops placed on devices, ``compile`` it into a Plan of actors, and ``run``
it on trio with streams, events and register quotas::

    import actorflow as af
    with af.Graph() as g:
        x = af.placeholder("x", shape=(32, 64), device="cpu:0")
        af.output("y", af.ops.relu(x))
    plan = af.compile(g, quota=2)
    out = af.run(plan, {"x": xs})
"""

__version__ = "0.1.0"

from . import ops, optim
from .compiler import compile
from .errors import (
    ActorflowError,
    CompileError,
    DeadlockError,
    FeedError,
    GraphError,
    PlanSerializationError,
    RankError,
    StallError,
)
from .graph import Graph, Tensor
from .parallel import (
    B,
    GlobalTensor,
    P,
    S,
    box,
    gradients,
    minimize,
    output,
    parameter,
    placeholder,
    recompute,
)
from .plan import Plan
from .runtime import Runtime, Session, run

__all__ = [
    "ActorflowError",
    "B",
    "CompileError",
    "DeadlockError",
    "FeedError",
    "GlobalTensor",
    "Graph",
    "GraphError",
    "P",
    "Plan",
    "PlanSerializationError",
    "RankError",
    "Runtime",
    "S",
    "Session",
    "StallError",
    "Tensor",
    "box",
    "compile",
    "gradients",
    "minimize",
    "ops",
    "optim",
    "output",
    "parameter",
    "placeholder",
    "recompute",
    "run",
]

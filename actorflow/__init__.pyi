from . import ops as ops, optim as optim
from .compiler import compile as compile
from .errors import (
    ActorflowError as ActorflowError,
    CompileError as CompileError,
    DeadlockError as DeadlockError,
    DeviceError as DeviceError,
    FeedError as FeedError,
    GraphError as GraphError,
    KernelError as KernelError,
    PlanSerializationError as PlanSerializationError,
    RankError as RankError,
    RankLost as RankLost,
    StallError as StallError,
)
from .graph import Graph as Graph, Tensor as Tensor
from .parallel import (
    B as B,
    GlobalTensor as GlobalTensor,
    P as P,
    S as S,
    box as box,
    gradients as gradients,
    minimize as minimize,
    output as output,
    parameter as parameter,
    placeholder as placeholder,
    recompute as recompute,
)
from .plan import Plan as Plan
from .runtime import Runtime as Runtime, Session as Session, run as run

__version__: str

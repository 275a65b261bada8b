"""actorflow: an actor-model dataflow runtime in the OneFlow style.

Build a graph of ops placed on devices, ``compile`` it into a Plan of actors, and ``run``
it on trio with streams, events and register quotas::

    import actorflow as af
    with af.Graph() as g:
        x = af.placeholder("x", shape=(32, 64), device="cpu:0")
        af.output("y", af.ops.relu(x))
    plan = af.compile(g, quota=2)
    out = af.run(plan, {"x": xs})

The public names, listed in ``__init__.pyi``, are imported on first use (PEP 562, through
``lazy_loader``), so a program or command that needs one part (``actorflow launch``,
``actorflow --help``) does not pay for the rest: importing everything takes about 0.4 s
of CPU, which each process of a launch paid.
"""

import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

"""``ACTORFLOW_DEBUG``: comma-separated debug flags, shared by the compiler and the runtime
(an unknown flag is a ValueError naming it):

- ``actors``: the runtime logs every act attempt (see ``runtime.debug``);
- ``passes``: ``compile`` checks the plan after each pass, naming the pass that broke it
  (see ``compiler.lint``).
"""

from __future__ import annotations

import os

ENV = "ACTORFLOW_DEBUG"
FLAGS = ("actors", "passes")


def debug_flags() -> frozenset[str]:
    """The flags set in ``ACTORFLOW_DEBUG``; a ValueError names any unknown one."""
    value = os.environ.get(ENV, "")
    flags = {f.strip() for f in value.split(",")} - {""}
    unknown = sorted(flags - set(FLAGS))
    if unknown:
        raise ValueError(
            f"{ENV}={value!r}: unknown flag {', '.join(map(repr, unknown))}; "
            f"the accepted flags are {', '.join(FLAGS)} (comma-separated)"
        )
    return frozenset(flags)

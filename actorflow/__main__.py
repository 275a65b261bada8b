"""``python -m actorflow``: the ``actorflow`` command, running the demo when no command is named."""

import sys

from .cli import main

args = sys.argv[1:]
if not args or args[0].startswith("-") and args[0] not in ("-h", "--help", "--version"):
    args = ["demo", *args]
sys.exit(main(args))

"""Recording what ran where and when, and exporting it for people to look at."""

from .recorder import Recorder, Span

__all__ = ["Recorder", "Span"]

"""Automatic differentiation: backward ops appended to the logical graph."""

from .gradients import gradients

__all__ = ["gradients"]

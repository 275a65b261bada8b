"""Device names: ``cpu:N`` are virtual CPU devices living in this process; ``cuda:N`` are
logical CUDA devices (``runtime.cuda`` places them on the GPUs, several to a GPU where
there are fewer GPUs than devices)."""

import re

_DEVICE = re.compile(r"^(cpu|cuda):(\d+)$")


def parse_device(device: str) -> str:
    """Return the canonical name of ``device`` or raise ValueError saying what is accepted."""
    if not isinstance(device, str):
        raise ValueError(f"a device is a string like 'cpu:0' or 'cuda:0', not {device!r}")
    match = _DEVICE.match(device.strip())
    if match is None:
        raise ValueError(f"unknown device {device!r}: devices are 'cpu:N' or 'cuda:N' (N = 0, 1, ...)")
    return f"{match.group(1)}:{int(match.group(2))}"


def device_order(device: str) -> tuple[str, int]:
    """A sort key putting devices in their numbers' order (``cpu:2`` before ``cpu:10``)."""
    kind, _, index = device.partition(":")
    return (kind, int(index)) if index.isdigit() else (kind, -1)


def is_cuda(device: str) -> bool:
    return device.startswith("cuda:")

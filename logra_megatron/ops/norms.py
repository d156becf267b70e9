"""Squared norms of large flat buffers without a full-size copy.

``buffer.double().pow(2).sum()`` materializes an fp64 copy of the buffer and then its square:
4x the buffer's bytes (an fp32 sketch buffer of 7.5 GiB costs 30 GiB of transient memory). Here
the buffer is read in chunks, each squared in fp64 and summed into one fp64 scalar on the
buffer's device, so the extra memory is two chunks and the result stays on the device until the
caller asks for it (one host sync, not one per chunk).
"""

import torch

CHUNK_ELEMENTS = 1 << 22
"""Elements per chunk: 4 Mi (32 MiB of fp64 temporaries), large enough to keep a GPU busy."""


def squared_norm(tensor: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``sum(tensor ** 2)`` accumulated in fp64, as a 0-d fp64 tensor on ``tensor``'s device."""
    flat = tensor.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for start in range(0, flat.numel(), chunk_elements):
        chunk = flat[start:start + chunk_elements].double()
        total += torch.dot(chunk, chunk)
    return total

"""Giving freed memory back to the operating system, where the C library is glibc.

glibc raises its mmap threshold each time it frees a block it had mapped, so that after a burst
of large buffers (a line near ``max_line_bytes``, the replies a slow reader left unread) later
ones come from the heap, where a small long-lived neighbour pins their pages: under churn the
resident size creeps up and is not given back when the burst is over. :func:`keep_large_blocks_mapped`
fixes the threshold, so large buffers stay in mappings of their own, unmapped when freed;
:func:`trim_loop` returns the heap's free pages every :data:`TRIM_EVERY_S`. With another C
library both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
LARGE_BLOCK = 128 * 1024  # glibc's own starting threshold
TRIM_EVERY_S = 30.0


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018  (both exist in glibc only)
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def keep_large_blocks_mapped() -> bool:
    """Fix the mmap threshold for the process; False where the C library is not glibc."""
    return _LIBC is not None and bool(_LIBC.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK))


def trim() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


async def trim_loop() -> None:
    """Trim every :data:`TRIM_EVERY_S`, until cancelled (a millisecond or two each time)."""
    while True:
        await asyncio.sleep(TRIM_EVERY_S)
        trim()

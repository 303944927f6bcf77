"""Checkpoints that survive an interruption: what a complete checkpoint folder is (:mod:`.files`), and saves written
whole or not at all, resumed from the newest complete one (:mod:`.saves`)."""

from .files import checkpoint_problems
from .saves import newest_complete_checkpoint, resolve_resume_checkpoint, save_checkpoint_atomically

__all__ = [
    "checkpoint_problems",
    "newest_complete_checkpoint",
    "resolve_resume_checkpoint",
    "save_checkpoint_atomically",
]

"""How far ranks, optimizer steps and micro-steps may go: one fact for the reader and the keys.

The reader (``validate``) refuses a run dir whose values lie outside these ranges, and the
checks fold (rank, step, micro_step) into one int64 (``checks.keys``) with exactly these many
bits each, so every value the reader accepts has its own key: a wider micro-step range here
widens both at once, never one without the other. 19 + 24 + 20 bits leave a key's top bit
free; ``place_key`` spends the 19 rank bits on a slot bit, a phase and a call position.
"""

from __future__ import annotations

RANK_BITS = 19
STEP_BITS = 24
MICRO_STEP_BITS = 20

MAX_RANK = (1 << RANK_BITS) - 1
MAX_STEP = (1 << STEP_BITS) - 1
MAX_MICRO_STEP = (1 << MICRO_STEP_BITS) - 1

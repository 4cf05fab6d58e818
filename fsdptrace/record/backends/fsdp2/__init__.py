"""Torch FSDP2 (``fully_shard``): every private attribute or method the recorder reads or wraps.

- ``units``: the ``Backend`` itself (units, prefetch edges, gradients, pending all-gathers);
- ``provenance``: wrappers on each parameter group that record its all-gathers, and
  ``issuers``: who issued each one, read from the call stack;
- ``grads``: a wrapper on each parameter group's ``post_backward`` that records what the
  unit's backward produced before its reduce-scatter, and the unit's settings;
- ``roots``: zero-code mode's test for a training forward entering an FSDP2 root;
- ``state``: where FSDP2 keeps a module's state and its parameter groups.

Nothing is imported here: ``roots`` runs in every process ``fsdptrace record`` starts, before
the script may import torch.
"""

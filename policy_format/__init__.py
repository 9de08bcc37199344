"""The policy checkpoint contract between the trainer and the policy server, implemented once.

Both sides import this package and nothing of each other (DESIGN.md): the trainer writes
a checkpoint's card and trains on sequences built here; the policy server reads the card
and builds its prompts here, with the same code. numpy and the standard library only.

- :mod:`policy_format.card`: ``policy.json`` — :class:`PolicyCard` (read, validate, write),
  the format version and a reader for every version;
- :mod:`policy_format.tokens`: :class:`TokenLayout`, :class:`StateTokenizer`,
  :class:`ActionTokenizer` and :class:`PolicyTokenizer`, whose ``sequence`` builds both
  prompts and training sequences;
- :mod:`policy_format.checkpoint`: a checkpoint directory validated as a whole
  (:func:`load_checkpoint`) and its digest;
- :mod:`policy_format.images`: :class:`CameraInput`, the cameras a card declares;
  :class:`VisionEncoder`, a vision policy's encoder and projector; :func:`pixel_values`,
  the image preprocessing the trainer and the server share.
"""

from policy_format.card import (
    FORMAT,
    FORMAT_VERSION,
    READERS,
    PolicyCard,
    PolicyFormatError,
    source_commit,
)
from policy_format.checkpoint import (
    WEIGHT_FILES,
    CheckpointError,
    PolicyCheckpoint,
    checkpoint_digest,
    load_checkpoint,
    write_lm_index,
)
from policy_format.images import (
    VISION_WEIGHTS,
    CameraInput,
    VisionEncoder,
    pixel_values,
    preprocess,
)
from policy_format.tokens import (
    IMAGE_PLACEHOLDER_ID,
    ActionTokenizer,
    PolicyTokenizer,
    StateTokenizer,
    TokenLayout,
    UniformTokenizer,
)

__all__ = [
    "FORMAT", "FORMAT_VERSION", "IMAGE_PLACEHOLDER_ID", "READERS", "VISION_WEIGHTS", "WEIGHT_FILES",
    "ActionTokenizer", "CameraInput", "CheckpointError", "PolicyCard", "PolicyCheckpoint", "PolicyFormatError", "PolicyTokenizer",
    "StateTokenizer", "TokenLayout", "UniformTokenizer", "VisionEncoder",
    "checkpoint_digest", "load_checkpoint", "pixel_values", "preprocess", "source_commit",
    "write_lm_index",
]

"""The cameras a policy takes: what a card's ``cameras`` entries say, in one dataclass.

A policy that sees images lists them in policy.json (format version 2, see
:mod:`policy_format.card`), in the order the prompt takes them::

    "cameras": [{"name": "corner", "height": 96, "width": 96, "resize": "bilinear", "scale": "unit"}]

- ``name``: the camera, as the simulator suite and the wire protocol's ``images`` map name
  it (``[A-Za-z0-9_.-]{1,64}``);
- ``height``, ``width``: the size the policy takes, pixels (1 to :data:`MAX_IMAGE_SIDE`); the
  server refuses other sizes and evaluations render at this one;
- ``resize``: how a frame of another size is brought to it where a pipeline resizes
  (training data recorded at another size): ``bilinear`` or ``nearest``;
- ``scale``: how uint8 pixels become model inputs; ``unit`` is ``pixel / 255`` in [0, 1].

Images always travel as uint8 [height, width, 3] RGB. The card's caps are the wire
protocol's (``services.protocol.messages``: ``MAX_CAMERAS``, ``MAX_IMAGE_SIDE``,
``CAMERA_NAME_PATTERN``), restated here because neither package imports the other; a test
in ``tests/policy_server`` checks that they agree. Turning frames into the prompt's image
rows (the vision encoder) is not here yet: until vision policies, cameras are declared and
validated, and the prompt stays task + state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CAMERAS = 16
MAX_IMAGE_SIDE = 4096
CAMERA_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESIZE_METHODS = ("bilinear", "nearest")
SCALES = ("unit",)


@dataclass(frozen=True)
class CameraInput:
    """One camera a policy takes: its name, the size it takes, and how frames are resized and scaled."""

    name: str
    height: int
    width: int
    resize: str = "bilinear"
    scale: str = "unit"

    @property
    def size(self) -> tuple[int, int]:
        """(height, width)."""
        return self.height, self.width

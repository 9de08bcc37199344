"""LeRobot v3.0 datasets (state, actions, camera videos or images, tasks, success): the writer and the reader.

A leaf package (numpy, pyarrow and PyAV only; nothing of ours), so that the trainer, which trains on
these datasets, and the evaluation workers, which record rollouts into them, share one implementation
without services importing ``trainer``. ``lerobot_format.dataset`` holds the code and documents the layout.
"""

from lerobot_format.dataset import (
    ACTION,
    CODEBASE_VERSION,
    ENV_STATE,
    EVALFORGE_PATH,
    IMAGE_DTYPES,
    IMAGE_PREFIX,
    STATE,
    CameraFrames,
    DatasetError,
    DemonstrationDataset,
    Episode,
    decode_png,
    decode_video,
    encode_png,
    encode_video,
    image_key,
    restore_normal_scheduling,
    write_dataset,
)

__all__ = ["ACTION", "CODEBASE_VERSION", "ENV_STATE", "EVALFORGE_PATH", "IMAGE_DTYPES", "IMAGE_PREFIX", "STATE", "CameraFrames",
           "DatasetError", "DemonstrationDataset", "Episode", "decode_png", "decode_video", "encode_png",
           "encode_video", "image_key", "restore_normal_scheduling", "write_dataset"]

"""The trainer's name for the LeRobot v3 dataset format, which lives in the ``lerobot_format`` leaf package.

The writer and the reader moved there so that the evaluation workers, which record rollouts as LeRobot
datasets, share them without importing ``trainer``; this module re-exports what the trainer, its tests
and benches use. The layout is documented in ``lerobot_format/dataset.py``.
"""

from lerobot_format.dataset import (  # noqa: F401  (re-exported)
    ACTION,
    CHUNKS_SIZE,
    CODEBASE_VERSION,
    DATA_FILES_SIZE_MB,
    DATA_PATH,
    ENV_STATE,
    EPISODES_PATH,
    EVALFORGE_PATH,
    IMAGE_DTYPES,
    IMAGE_PREFIX,
    STATE,
    VIDEO_CODEC,
    VIDEO_ENCODER_INFO,
    VIDEO_FILES_SIZE_MB,
    VIDEO_PATH,
    CameraFrames,
    DatasetError,
    DemonstrationDataset,
    Episode,
    concatenate_videos,
    decode_png,
    decode_video,
    encode_png,
    encode_video,
    image_histogram,
    image_key,
    restore_normal_scheduling,
    stats_sample_indices,
    video_info,
    write_dataset,
)

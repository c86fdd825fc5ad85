"""The server's own defaults that its flags show (serve --help reads them here, without torch,
FastAPI or the engine): what one image or video may weigh or last, and the runtime-LoRA flag."""

MAX_IMAGE_BYTES = 20 * 2 ** 20  # one image (data URI, file or URL)
MAX_VIDEO_BYTES = 256 * 2 ** 20  # one video
# most frames sampled from one video: the Qwen3-VL video processor's max_frames
MAX_VIDEO_FRAMES = 768
MAX_VIDEO_SECONDS = 3600.0  # longest video, by its container's duration
RUNTIME_FLAG = "--allow-runtime-lora-updating"

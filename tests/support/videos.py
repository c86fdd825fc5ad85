"""Video clips for the tests, drawn and encoded here with PyAV: nothing is downloaded."""
import io

import av
import numpy as np


def drawn_clip(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [T, H, W, 3]: a smooth random background with a bright square moving one step per
    frame, so every frame differs and a frame can be told from its neighbours after lossy coding
    (its square's position)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3)).astype(np.uint8)
    base = np.kron(base, np.ones((8, 8, 1), np.uint8))[:height, :width]
    clip = np.repeat(base[None], num_frames, axis=0).copy()
    side = max(4, min(height, width) // 6)
    for t in range(num_frames):
        y = (t * 3) % max(1, height - side)
        x = (t * 5) % max(1, width - side)
        clip[t, y:y + side, x:x + side] = 255
    return clip


def encode(frames: np.ndarray, fps: int, codec: str = "libx264", container: str = "mp4",
           gop: int | None = None, path=None) -> bytes:
    """Encode uint8 [T, H, W, 3] frames; returns the file's bytes (and writes them to `path` if
    given)."""
    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    stream = out.add_stream(codec, rate=fps)
    stream.height, stream.width = frames.shape[1], frames.shape[2]
    stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    if gop is not None:
        stream.codec_context.gop_size = gop
    if codec == "libx264":
        stream.options = {"preset": "ultrafast", "crf": "10"}
    for frame in frames:
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    data = buf.getvalue()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data


def blank_video(width: int, height: int, num_frames: int, fps: int, codec: str = "libx264",
                container: str = "mp4") -> bytes:
    """A clip of black frames, made without an RGB array (cheap at any size): a few KiB that decode
    to width x height pixels per frame."""
    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    stream = out.add_stream(codec, rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    if codec == "libx264":
        stream.options = {"preset": "ultrafast"}
    frame = av.VideoFrame(width, height, "yuv420p")
    for plane in frame.planes:
        plane.update(bytes(plane.buffer_size))
    for i in range(num_frames):
        frame.pts = i
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buf.getvalue()

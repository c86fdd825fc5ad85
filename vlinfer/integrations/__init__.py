"""vlinfer inside other frameworks. Each module here is a user of the public API (LLM, the batch
jobs' records, the server's app), like apps/: `ray_caption` and `ray_embed` (batch captioning and
embedding over a Ray cluster with Ray Data; `ray_data` holds what they share) and `ray_serve`
(engine replicas behind one OpenAI-compatible endpoint with Ray Serve). Ray is an optional extra:
`pip install 'vlinfer[ray]'`."""


class MissingDependencyError(ImportError):
    """An optional package a feature needs is not installed; the message says what to install."""


def require_ray():
    """The `ray` module, or an error that says how to get it."""
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError(
            "--ray needs Ray: pip install 'vlinfer[ray]' (ray[data,serve])") from e
    return ray

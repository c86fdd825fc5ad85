"""The one loop that runs requests to their end: step the engine, hand out their outputs, and abort
what is left when stepping stops early (a failed step, an interrupt, a caller that stops reading),
so no request is left holding KV blocks. LLM, Pipeline.stream and the CLI chat drive their requests
with drive(); the server's EngineLoop, whose requests come and go between steps and which outlives
a failed step, runs step() over every request in its engine."""
from collections.abc import Iterable, Iterator

from vlinfer.outputs import PoolingRequestOutput, RequestOutput


def abort(engine, request_ids: Iterable[str]) -> None:
    for request_id in list(request_ids):  # a copy: an abort takes its id out of engine.requests
        engine.abort_request(request_id)


def step(engine, request_ids: Iterable[str]) -> list[RequestOutput | PoolingRequestOutput]:
    """One engine step. When it raises, request_ids (read only then) are aborted before the error
    goes on."""
    try:
        return engine.step()
    except BaseException:
        abort(engine, request_ids)
        raise


def drive(engine, request_ids: Iterable[str]) -> Iterator[RequestOutput | PoolingRequestOutput]:
    """Step the engine until the requests request_ids (ids add_request returned, which outputs
    carry) have finished, yielding their outputs as each step makes them; other requests step
    along, their outputs dropped. Those still running are aborted when the loop stops early: a step
    fails, the caller is interrupted, or it closes (or drops) the generator before the end."""
    wanted = set(request_ids)
    live = [seq.request_id for seq in engine.requests.values() if seq.parent_id in wanted]
    while live:
        outputs = step(engine, live)
        try:
            live = [request_id for request_id in live if request_id in engine.requests]
            for out in outputs:
                if out.request_id in wanted:
                    yield out
        except BaseException:  # GeneratorExit: the caller stopped reading
            abort(engine, live)
            raise

"""The runner of `transform` stages: load what the stage needs, call its pure function, hand over."""

from __future__ import annotations

import structlog

from threadline.pipeline.errors import ThreadlineError
from threadline.pipeline.stages import Stage, StageInput
from threadline.workers.worker.loaders import LOADERS
from threadline.workers.worker.runners.common import (
    envelope_of,
    hand_over,
    start_stage,
)
from threadline.workers.worker.runtime import Runtime

log = structlog.get_logger(__name__)


async def run_transform(rt: Runtime, stage: Stage, envelope: object) -> None:
    if (env := await envelope_of(rt, stage, envelope)) is None or (s := await start_stage(rt, stage, env)) is None:
        return
    assert stage.run is not None
    try:
        loaded = {need: await LOADERS[need](rt, s.turn, stage.name) for need in stage.needs}
        out = stage.run(StageInput(s.turn, s.begin.previous, loaded))
    except ThreadlineError as e:
        await rt.end_turn(env.turn_id, "failed", code=e.code, message=e.message, resolved=s.turn)
        return
    log.info("stage_decided", **out.decision)
    await hand_over(rt, stage, s, out.artifact, out.decision)

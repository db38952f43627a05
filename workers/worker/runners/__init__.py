"""One runner per kind of stage (`pipeline.stages.StageKind`), none of which names a stage.

Every runner is the same shape: begin (the store checks that the turn is live, not cancelled, not
past its deadline, and that this stage has not run) → log context → the stage's pure function →
hand over to the next stage in one atomic step. Every early ending goes through
`Runtime.end_turn`. Besides them: the control queue's `cancel.py` and the completion webhooks'
`webhook.py` (after the turn, on its own queue).
"""
